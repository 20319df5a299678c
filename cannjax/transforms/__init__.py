"""Function transforms: each wraps a user function (fuse, remat, amp, parallel)."""

from cannjax.transforms import parallel as parallel
