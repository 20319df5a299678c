"""Gradient health: statistics inside jit, a monitor with flags, NaN localization
(``docs/health.md``).
"""

from cannjax._src.health.localize import NonFiniteReport as NonFiniteReport
from cannjax._src.health.localize import find_nonfinite as find_nonfinite
from cannjax._src.health.monitor import GradMonitor as GradMonitor
from cannjax._src.health.monitor import HealthFlag as HealthFlag
from cannjax._src.health.statistics import GradStats as GradStats
from cannjax._src.health.statistics import grad_stats as grad_stats

__all__ = [
    "GradMonitor",
    "GradStats",
    "HealthFlag",
    "NonFiniteReport",
    "find_nonfinite",
    "grad_stats",
]
