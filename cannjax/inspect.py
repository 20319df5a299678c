"""What a backward keeps (residuals), what a compiled program needs (memory), what was
fused,
and what ``cannjax.optimize`` replaced.
"""

from cannjax._src.inspect import FusionReport as FusionReport
from cannjax._src.inspect import FusionRow as FusionRow
from cannjax._src.inspect import MemoryReport as MemoryReport
from cannjax._src.inspect import OptimizeReport as OptimizeReport
from cannjax._src.inspect import OptimizeRow as OptimizeRow
from cannjax._src.inspect import Residual as Residual
from cannjax._src.inspect import ResidualReport as ResidualReport
from cannjax._src.inspect import compiled_memory as compiled_memory
from cannjax._src.inspect import fusion as fusion
from cannjax._src.inspect import memory as memory
from cannjax._src.inspect import optimize as optimize
from cannjax._src.inspect import residuals as residuals

__all__ = [
    "FusionReport",
    "FusionRow",
    "MemoryReport",
    "OptimizeReport",
    "OptimizeRow",
    "Residual",
    "ResidualReport",
    "compiled_memory",
    "fusion",
    "memory",
    "optimize",
    "residuals",
]
