"""The Ascend kernel table: which cannjax operators run CANN kernels, and its switches."""

from cannjax._src.backend.ascend import DEFAULT_TARGETS as DEFAULT_TARGETS
from cannjax._src.backend.ascend import KERNELS_ENV as KERNELS_ENV
from cannjax._src.backend.ascend import TARGET_SIGNATURES as TARGET_SIGNATURES
from cannjax._src.backend.ascend import AscendConfig as AscendConfig
from cannjax._src.backend.ascend import TargetTable as TargetTable
from cannjax._src.backend.ascend import config as config
from cannjax._src.backend.ascend import configure as configure
from cannjax._src.backend.ascend import disabled_checks as disabled_checks
from cannjax._src.backend.ascend import install as install
from cannjax._src.backend.ascend import should_install as should_install
from cannjax._src.backend.ascend import uninstall as uninstall

__all__ = [
    "DEFAULT_TARGETS",
    "KERNELS_ENV",
    "TARGET_SIGNATURES",
    "AscendConfig",
    "TargetTable",
    "config",
    "configure",
    "disabled_checks",
    "install",
    "should_install",
    "uninstall",
]
