"""The operator model: declare, register and look up operators; per-platform kernels and
matrix-product forms.

An operator is declared once with :func:`defop` (forward, tangent rule, hand-written
backward) and described by an :class:`OpSpec` that the test harness and the tools read
(``docs/architecture.md``).
"""

from cannjax._src.core.dots import DotForm as DotForm
from cannjax._src.core.dots import dot_form as dot_form
from cannjax._src.core.dots import dot_form_table as dot_form_table
from cannjax._src.core.dots import register_dot_form as register_dot_form
from cannjax._src.core.kernels import Kernel as Kernel
from cannjax._src.core.kernels import kernel_table as kernel_table
from cannjax._src.core.kernels import register_kernel as register_kernel
from cannjax._src.core.kernels import unregister_kernel as unregister_kernel
from cannjax._src.core.operator import Operator as Operator
from cannjax._src.core.operator import defop as defop
from cannjax._src.core.operator import registered as registered
from cannjax._src.core.registry import EdgeCase as EdgeCase
from cannjax._src.core.registry import Level as Level
from cannjax._src.core.registry import OpSpec as OpSpec
from cannjax._src.core.registry import lookup as lookup
from cannjax._src.core.registry import register as register
from cannjax._src.core.registry import registry as registry
from cannjax._src.core.registry import written_for as written_for

__all__ = [
    "DotForm",
    "EdgeCase",
    "Kernel",
    "Level",
    "OpSpec",
    "Operator",
    "defop",
    "dot_form",
    "dot_form_table",
    "kernel_table",
    "lookup",
    "register",
    "register_dot_form",
    "register_kernel",
    "registered",
    "registry",
    "unregister_kernel",
    "written_for",
]
