"""Elementwise fusion: a chain of elementwise primitives becomes one operator that keeps
one residual (``docs/fuse.md``). :func:`fuse` is also ``cannjax.fuse``.
"""

from cannjax._src.fuse.transform import LEVELS as LEVELS
from cannjax._src.fuse.transform import fuse as fuse

__all__ = [
    "LEVELS",
    "fuse",
]
