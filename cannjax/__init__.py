"""cannjax: gradient engineering for JAX: operators with hand-written backward rules."""

from cannjax import amp as amp
from cannjax import core as core
from cannjax import inspect as inspect
from cannjax import ops as ops
from cannjax import testing as testing
from cannjax.core import defop as defop
from cannjax.core import register as register
from cannjax.core import registry as registry

__version__ = "0.1.0"

__all__ = ["amp", "core", "defop", "inspect", "ops", "register", "registry", "testing"]
