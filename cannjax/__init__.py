"""cannjax: gradient engineering for JAX: operators with hand-written backward rules.

Each feature has one public module (:mod:`cannjax.ops`, :mod:`cannjax.core`,
:mod:`cannjax.fusion`, :mod:`cannjax.optimization`, :mod:`cannjax.remat`,
:mod:`cannjax.amp`, :mod:`cannjax.parallel`, :mod:`cannjax.dynamic`, :mod:`cannjax.health`,
:mod:`cannjax.inspect`,
:mod:`cannjax.backend`, :mod:`cannjax.testing`, :mod:`cannjax.models`), and every public
object one address there.
The names below are the only aliases, for the entry points of the README's first
example (``docs/api.md``):

* ``cannjax.defop`` is :func:`cannjax.core.defop`
* ``cannjax.register`` is :func:`cannjax.core.register`
* ``cannjax.fuse`` is :func:`cannjax.fusion.fuse`
* ``cannjax.optimize`` is :func:`cannjax.optimization.optimize`
"""

from cannjax import amp as amp
from cannjax import backend as backend
from cannjax import core as core
from cannjax import dynamic as dynamic
from cannjax import fusion as fusion
from cannjax import health as health
from cannjax import inspect as inspect
from cannjax import ops as ops
from cannjax import optimization as optimization
from cannjax import parallel as parallel
from cannjax import remat as remat
from cannjax import testing as testing
from cannjax.core import defop as defop
from cannjax.core import register as register
from cannjax.fusion import fuse as fuse
from cannjax.optimization import optimize as optimize

__version__ = "0.1.0"

# The top-level aliases: each is also reachable at its canonical path (docs/api.md).
__all__ = ["defop", "fuse", "optimize", "register"]
