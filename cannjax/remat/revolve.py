"""Binomial checkpointing (Revolve): the optimal schedule of a reversal under a fixed
number of checkpoints.
"""

from cannjax._src.remat.revolve import Schedule as Schedule
from cannjax._src.remat.revolve import advances as advances
from cannjax._src.remat.revolve import advances_dp as advances_dp
from cannjax._src.remat.revolve import default_checkpoints as default_checkpoints
from cannjax._src.remat.revolve import schedule as schedule

__all__ = [
    "Schedule",
    "advances",
    "advances_dp",
    "default_checkpoints",
    "schedule",
]
