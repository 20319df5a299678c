"""Remat policies over cannjax's named residuals ``cannjax.<op>.<what>``, for
:func:`cannjax.remat.checkpoint`.
"""

from cannjax._src.remat.policies import STATISTICS as STATISTICS
from cannjax._src.remat.policies import SaveNames as SaveNames
from cannjax._src.remat.policies import any_of as any_of
from cannjax._src.remat.policies import everything_saveable as everything_saveable
from cannjax._src.remat.policies import nothing_saveable as nothing_saveable
from cannjax._src.remat.policies import save_all_but_elementwise as save_all_but_elementwise
from cannjax._src.remat.policies import save_dots as save_dots
from cannjax._src.remat.policies import save_names as save_names
from cannjax._src.remat.policies import save_operator_residuals as save_operator_residuals
from cannjax._src.remat.policies import save_ops as save_ops
from cannjax._src.remat.policies import save_statistics as save_statistics

__all__ = [
    "STATISTICS",
    "SaveNames",
    "any_of",
    "everything_saveable",
    "nothing_saveable",
    "save_all_but_elementwise",
    "save_dots",
    "save_names",
    "save_operator_residuals",
    "save_ops",
    "save_statistics",
]
