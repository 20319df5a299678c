"""Operator substitution, fusion and remat for unmodified JAX, flax and equinox code
(``docs/optimize.md``). :func:`optimize` is also ``cannjax.optimize``.
"""

from cannjax._src.optimization.transform import LEVELS as LEVELS
from cannjax._src.optimization.transform import optimize as optimize

__all__ = [
    "LEVELS",
    "optimize",
]
