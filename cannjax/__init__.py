"""cannjax: gradient engineering for JAX: operators with hand-written backward rules."""

from cannjax import core as core
from cannjax import inspect as inspect
from cannjax import ops as ops
from cannjax import testing as testing
from cannjax import transforms as transforms
from cannjax.core import defop as defop
from cannjax.core import register as register
from cannjax.core import registry as registry
from cannjax.transforms import remat as remat
from cannjax.transforms.scan import checkpointed_scan as checkpointed_scan

__version__ = "0.1.0"

__all__ = [
    "checkpointed_scan",
    "core",
    "defop",
    "inspect",
    "ops",
    "register",
    "registry",
    "remat",
    "testing",
    "transforms",
]
