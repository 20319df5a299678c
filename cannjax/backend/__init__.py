"""Backends: the platform facts, the Ascend kernel table and PJRT plugin reporting.

:func:`facts` is the one answer to what cannjax does per platform (half dtype, overflow
mode, padding multiple); amp, parallel and :func:`info` read it. :mod:`cannjax.backend.ascend`
configures the Ascend table (``docs/ascend.md``). :func:`keep_freed_memory` makes glibc
keep freed host memory for XLA:CPU's next step (``docs/performance.md``).
"""

from cannjax._src.backend.host_memory import keep_freed_memory as keep_freed_memory
from cannjax._src.backend.info import BackendInfo as BackendInfo
from cannjax._src.backend.info import PluginEntry as PluginEntry
from cannjax._src.backend.info import info as info
from cannjax._src.backend.info import installed_plugins as installed_plugins
from cannjax._src.backend.padding import matmul_padding as matmul_padding
from cannjax._src.backend.padding import pad_for_platform as pad_for_platform
from cannjax._src.core.platform import OVERFLOW_MODES as OVERFLOW_MODES
from cannjax._src.core.platform import PlatformFacts as PlatformFacts
from cannjax._src.core.platform import facts as facts
from cannjax.backend import ascend as ascend

__all__ = [
    "OVERFLOW_MODES",
    "BackendInfo",
    "PlatformFacts",
    "PluginEntry",
    "facts",
    "info",
    "installed_plugins",
    "keep_freed_memory",
    "matmul_padding",
    "pad_for_platform",
]
