"""What a backward keeps (residuals), what a compiled program needs (memory), what was
fused.
"""

from cannjax._src.inspect import FusionReport as FusionReport
from cannjax._src.inspect import FusionRow as FusionRow
from cannjax._src.inspect import MemoryReport as MemoryReport
from cannjax._src.inspect import Residual as Residual
from cannjax._src.inspect import ResidualReport as ResidualReport
from cannjax._src.inspect import compiled_memory as compiled_memory
from cannjax._src.inspect import fusion as fusion
from cannjax._src.inspect import memory as memory
from cannjax._src.inspect import residuals as residuals

__all__ = [
    "FusionReport",
    "FusionRow",
    "MemoryReport",
    "Residual",
    "ResidualReport",
    "compiled_memory",
    "fusion",
    "memory",
    "residuals",
]
