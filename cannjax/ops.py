"""Operators, each with a hand-written backward, registered for :func:`cannjax.testing.check_op`."""

from cannjax._src.ops.attention import attention as attention
from cannjax._src.ops.attention import attention_block_sizes as attention_block_sizes
from cannjax._src.ops.distillation import jensen_shannon as jensen_shannon
from cannjax._src.ops.distillation import kl_divergence as kl_divergence
from cannjax._src.ops.distillation import linear_jensen_shannon as linear_jensen_shannon
from cannjax._src.ops.elementwise import cos as cos
from cannjax._src.ops.elementwise import erf as erf
from cannjax._src.ops.elementwise import exp as exp
from cannjax._src.ops.elementwise import expm1 as expm1
from cannjax._src.ops.elementwise import gelu as gelu
from cannjax._src.ops.elementwise import log as log
from cannjax._src.ops.elementwise import log1p as log1p
from cannjax._src.ops.elementwise import log_sigmoid as log_sigmoid
from cannjax._src.ops.elementwise import relu as relu
from cannjax._src.ops.elementwise import rsqrt as rsqrt
from cannjax._src.ops.elementwise import sigmoid as sigmoid
from cannjax._src.ops.elementwise import silu as silu
from cannjax._src.ops.elementwise import sin as sin
from cannjax._src.ops.elementwise import softplus as softplus
from cannjax._src.ops.elementwise import sqrt as sqrt
from cannjax._src.ops.elementwise import square as square
from cannjax._src.ops.elementwise import tanh as tanh
from cannjax._src.ops.gated import geglu as geglu
from cannjax._src.ops.gated import swiglu as swiglu
from cannjax._src.ops.linalg import linear as linear
from cannjax._src.ops.linalg import matmul as matmul
from cannjax._src.ops.linear_cross_entropy import linear_cross_entropy as linear_cross_entropy
from cannjax._src.ops.lora import lora_linear as lora_linear
from cannjax._src.ops.losses import softmax_cross_entropy as softmax_cross_entropy
from cannjax._src.ops.normalization import layer_norm as layer_norm
from cannjax._src.ops.normalization import rms_norm as rms_norm
from cannjax._src.ops.positional import apply_rope as apply_rope
from cannjax._src.ops.positional import rope as rope
from cannjax._src.ops.positional import rope_frequencies as rope_frequencies
from cannjax._src.ops.preference import PreferenceMetrics as PreferenceMetrics
from cannjax._src.ops.preference import linear_preference_loss as linear_preference_loss
from cannjax._src.ops.reductions import log_softmax as log_softmax
from cannjax._src.ops.reductions import logsumexp as logsumexp
from cannjax._src.ops.reductions import softmax as softmax
from cannjax._src.ops.safe import arctan2 as arctan2
from cannjax._src.ops.safe import cosine_similarity as cosine_similarity
from cannjax._src.ops.safe import entropy as entropy
from cannjax._src.ops.safe import norm as norm
from cannjax._src.ops.safe import normalize as normalize
from cannjax._src.ops.safe import xlogy as xlogy

__all__ = [
    "PreferenceMetrics",
    "apply_rope",
    "arctan2",
    "attention",
    "attention_block_sizes",
    "cos",
    "cosine_similarity",
    "entropy",
    "erf",
    "exp",
    "expm1",
    "geglu",
    "gelu",
    "jensen_shannon",
    "kl_divergence",
    "layer_norm",
    "linear",
    "linear_cross_entropy",
    "linear_jensen_shannon",
    "linear_preference_loss",
    "log",
    "log1p",
    "log_sigmoid",
    "log_softmax",
    "logsumexp",
    "lora_linear",
    "matmul",
    "norm",
    "normalize",
    "relu",
    "rms_norm",
    "rope",
    "rope_frequencies",
    "rsqrt",
    "sigmoid",
    "silu",
    "sin",
    "softmax",
    "softmax_cross_entropy",
    "softplus",
    "sqrt",
    "square",
    "swiglu",
    "tanh",
    "xlogy",
]
