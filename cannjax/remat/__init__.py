"""Rematerialization: checkpointed scans, named-residual policies and a budget planner.

See ``docs/remat.md``; :mod:`cannjax.remat.policies` holds the policies and
:mod:`cannjax.remat.revolve` the binomial (Revolve) schedule.
"""

from cannjax._src.remat.checkpoint import checkpoint as checkpoint
from cannjax._src.remat.planner import Plan as Plan
from cannjax._src.remat.planner import plan as plan
from cannjax._src.remat.scan import SCHEDULES as SCHEDULES
from cannjax._src.remat.scan import checkpointed_scan as checkpointed_scan
from cannjax.remat import policies as policies
from cannjax.remat import revolve as revolve

__all__ = [
    "SCHEDULES",
    "Plan",
    "checkpoint",
    "checkpointed_scan",
    "plan",
]
