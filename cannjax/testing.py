"""The harness every operator passes: values and gradients against the reference and
float64 finite differences, both modes, at random and edge points.
"""

from cannjax._src.accuracy import measure_accuracy as measure_accuracy
from cannjax._src.testing import check_op as check_op
from cannjax._src.testing import tolerance as tolerance

__all__ = [
    "check_op",
    "measure_accuracy",
    "tolerance",
]
