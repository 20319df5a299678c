"""Function transforms: each wraps a user function (fuse, remat, amp, parallel)."""

from cannjax.transforms import parallel as parallel
from cannjax.transforms.fuse import LEVELS as LEVELS
from cannjax.transforms.fuse import fuse as fuse

__all__ = ["LEVELS", "fuse", "parallel"]
