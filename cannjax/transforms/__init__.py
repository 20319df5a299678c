"""Function transforms (floor 3): each module is one transform (fuse, remat, amp, parallel).

Public names are also re-exported from their own namespaces (``cannjax.fuse``,
``cannjax.remat``, ``cannjax.amp``, ``cannjax.parallel``).
"""

from cannjax.transforms import amp as amp
from cannjax.transforms import loss_scale as loss_scale
from cannjax.transforms import parallel as parallel
from cannjax.transforms import precision as precision
from cannjax.transforms import remat as remat
from cannjax.transforms.fuse import LEVELS as LEVELS
from cannjax.transforms.fuse import fuse as fuse
from cannjax.transforms.scan import checkpointed_scan as checkpointed_scan

__all__ = [
    "LEVELS",
    "amp",
    "checkpointed_scan",
    "fuse",
    "loss_scale",
    "parallel",
    "precision",
    "remat",
]
