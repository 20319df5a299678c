"""cannjax: gradient engineering for JAX: operators with hand-written backward rules."""

from cannjax import amp as amp
from cannjax import backend as backend
from cannjax import core as core
from cannjax import health as health
from cannjax import inspect as inspect
from cannjax import ops as ops
from cannjax import parallel as parallel
from cannjax import remat as remat
from cannjax import testing as testing
from cannjax import transforms as transforms
from cannjax.core import defop as defop
from cannjax.core import register as register
from cannjax.core import registry as registry
from cannjax.transforms import fuse as fuse
from cannjax.transforms.scan import checkpointed_scan as checkpointed_scan

__version__ = "0.1.0"

__all__ = [
    "amp",
    "backend",
    "checkpointed_scan",
    "core",
    "defop",
    "fuse",
    "health",
    "inspect",
    "ops",
    "parallel",
    "register",
    "registry",
    "remat",
    "testing",
    "transforms",
]
