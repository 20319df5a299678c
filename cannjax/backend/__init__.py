"""Backends: per-platform defaults, the Ascend kernel table and PJRT plugin reporting."""

from cannjax.backend import ascend as ascend
from cannjax.backend.info import BackendInfo as BackendInfo
from cannjax.backend.info import PluginEntry as PluginEntry
from cannjax.backend.info import info as info
from cannjax.backend.info import installed_plugins as installed_plugins
from cannjax.backend.padding import matmul_padding as matmul_padding
from cannjax.backend.padding import pad_for_platform as pad_for_platform
from cannjax.backend.policy import OVERFLOW_MODES as OVERFLOW_MODES
from cannjax.backend.policy import detect_overflow as detect_overflow
from cannjax.backend.policy import is_ascend as is_ascend
from cannjax.backend.policy import matmul_multiple as matmul_multiple
from cannjax.backend.policy import overflow_mode as overflow_mode
from cannjax.backend.policy import preferred_half_dtype as preferred_half_dtype

__all__ = [
    "OVERFLOW_MODES",
    "BackendInfo",
    "PluginEntry",
    "ascend",
    "detect_overflow",
    "info",
    "installed_plugins",
    "is_ascend",
    "matmul_multiple",
    "matmul_padding",
    "overflow_mode",
    "pad_for_platform",
    "preferred_half_dtype",
]
