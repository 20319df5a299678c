"""The operator model: declare, register and look up operators; per-platform kernels."""

from cannjax.core.defop import Operator as Operator
from cannjax.core.defop import defop as defop
from cannjax.core.kernels import Kernel as Kernel
from cannjax.core.kernels import kernel_table as kernel_table
from cannjax.core.kernels import register_kernel as register_kernel
from cannjax.core.kernels import unregister_kernel as unregister_kernel
from cannjax.core.registry import EdgeCase as EdgeCase
from cannjax.core.registry import Level as Level
from cannjax.core.registry import OpSpec as OpSpec
from cannjax.core.registry import lookup as lookup
from cannjax.core.registry import register as register
from cannjax.core.registry import registry as registry

__all__ = [
    "EdgeCase",
    "Kernel",
    "Level",
    "OpSpec",
    "Operator",
    "defop",
    "kernel_table",
    "lookup",
    "register",
    "register_kernel",
    "registry",
    "unregister_kernel",
]
