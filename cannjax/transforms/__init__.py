"""Function transforms: ``fuse`` (elementwise fusion with one residual per cluster)."""

from cannjax.transforms.fuse import LEVELS as LEVELS
from cannjax.transforms.fuse import fuse as fuse

__all__ = ["LEVELS", "fuse"]
