"""Rematerialization (public face of :mod:`cannjax.transforms.remat`).

``from cannjax.remat import checkpointed_scan, checkpoint, plan, policies`` works, as does
``cannjax.remat.plan(...)``.
"""

from cannjax.transforms.remat import SCHEDULES as SCHEDULES
from cannjax.transforms.remat import Plan as Plan
from cannjax.transforms.remat import checkpoint as checkpoint
from cannjax.transforms.remat import checkpointed_scan as checkpointed_scan
from cannjax.transforms.remat import plan as plan
from cannjax.transforms.remat import policies as policies
from cannjax.transforms.remat import revolve as revolve

__all__ = ["SCHEDULES", "Plan", "checkpoint", "checkpointed_scan", "plan", "policies", "revolve"]
