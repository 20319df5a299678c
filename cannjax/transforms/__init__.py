"""Function transforms: rematerialization (and, from other modules, fusion)."""

from cannjax.transforms import remat as remat
from cannjax.transforms.scan import checkpointed_scan as checkpointed_scan

__all__ = ["checkpointed_scan", "remat"]
