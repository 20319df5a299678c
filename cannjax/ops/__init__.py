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
from cannjax.ops.linear_cross_entropy import linear_cross_entropy as linear_cross_entropy

__all__ = [
    "attention",
    "attention_block_sizes",
    "cos",
    "erf",
    "exp",
    "expm1",
    "gelu",
    "linear_cross_entropy",
    "log",
    "log1p",
    "log_sigmoid",
    "registry",
    "relu",
    "rsqrt",
    "sigmoid",
    "silu",
    "sin",
    "softplus",
    "sqrt",
    "square",
    "tanh",
]
