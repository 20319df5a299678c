"""Variable-length training without a compile per shape: gears, padding with weights, and
a step compiled once per gear (``docs/dynamic.md``).
"""

from cannjax._src.dynamic.gears import Gears as Gears
from cannjax._src.dynamic.gears import fixed_gears as fixed_gears
from cannjax._src.dynamic.gears import plan_gears as plan_gears
from cannjax._src.dynamic.gears import power_of_two_gears as power_of_two_gears
from cannjax._src.dynamic.padding import pad_to_gear as pad_to_gear
from cannjax._src.dynamic.step import GearedStep as GearedStep
from cannjax._src.dynamic.step import geared as geared

__all__ = [
    "GearedStep",
    "Gears",
    "fixed_gears",
    "geared",
    "pad_to_gear",
    "plan_gears",
    "power_of_two_gears",
]
