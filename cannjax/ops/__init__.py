"""cannjax operators: each with a hand-written backward, registered for check_op."""

from cannjax.core.registry import registry as registry
from cannjax.ops.attention import attention as attention
from cannjax.ops.attention import attention_block_sizes as attention_block_sizes
from cannjax.ops.elementwise import cos as cos
from cannjax.ops.elementwise import erf as erf
from cannjax.ops.elementwise import exp as exp
from cannjax.ops.elementwise import expm1 as expm1
from cannjax.ops.elementwise import gelu as gelu
from cannjax.ops.elementwise import log as log
from cannjax.ops.elementwise import log1p as log1p
from cannjax.ops.elementwise import log_sigmoid as log_sigmoid
from cannjax.ops.elementwise import relu as relu
from cannjax.ops.elementwise import rsqrt as rsqrt
from cannjax.ops.elementwise import sigmoid as sigmoid
from cannjax.ops.elementwise import silu as silu
from cannjax.ops.elementwise import sin as sin
from cannjax.ops.elementwise import softplus as softplus
from cannjax.ops.elementwise import sqrt as sqrt
from cannjax.ops.elementwise import square as square
from cannjax.ops.elementwise import tanh as tanh
from cannjax.ops.linalg import linear as linear
from cannjax.ops.linalg import matmul as matmul
from cannjax.ops.linear_cross_entropy import linear_cross_entropy as linear_cross_entropy
from cannjax.ops.losses import softmax_cross_entropy as softmax_cross_entropy
from cannjax.ops.normalization import layer_norm as layer_norm
from cannjax.ops.normalization import rms_norm as rms_norm
from cannjax.ops.reductions import log_softmax as log_softmax
from cannjax.ops.reductions import logsumexp as logsumexp
from cannjax.ops.reductions import softmax as softmax
from cannjax.ops.safe import arctan2 as arctan2
from cannjax.ops.safe import cosine_similarity as cosine_similarity
from cannjax.ops.safe import entropy as entropy
from cannjax.ops.safe import norm as norm
from cannjax.ops.safe import normalize as normalize
from cannjax.ops.safe import xlogy as xlogy

__all__ = [
    "arctan2",
    "attention",
    "attention_block_sizes",
    "cos",
    "cosine_similarity",
    "entropy",
    "erf",
    "exp",
    "expm1",
    "gelu",
    "layer_norm",
    "linear",
    "linear_cross_entropy",
    "linear_cross_entropy",
    "log",
    "log1p",
    "log_sigmoid",
    "log_softmax",
    "logsumexp",
    "matmul",
    "norm",
    "normalize",
    "registry",
    "relu",
    "rms_norm",
    "rsqrt",
    "sigmoid",
    "silu",
    "sin",
    "softmax",
    "softmax_cross_entropy",
    "softplus",
    "sqrt",
    "square",
    "tanh",
    "xlogy",
]
