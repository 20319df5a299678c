"""Gradient health: statistics inside jit, a monitor with flags, NaN localization
(``docs/health.md``).
"""

from cannjax._src.health.health import GradMonitor as GradMonitor
from cannjax._src.health.health import GradStats as GradStats
from cannjax._src.health.health import HealthFlag as HealthFlag
from cannjax._src.health.health import NonFiniteReport as NonFiniteReport
from cannjax._src.health.health import find_nonfinite as find_nonfinite
from cannjax._src.health.health import grad_stats as grad_stats

__all__ = [
    "GradMonitor",
    "GradStats",
    "HealthFlag",
    "NonFiniteReport",
    "find_nonfinite",
    "grad_stats",
]
