"""The operator model: declare, register and look up operators."""

from cannjax.core.defop import Operator as Operator
from cannjax.core.defop import defop as defop
from cannjax.core.registry import EdgeCase as EdgeCase
from cannjax.core.registry import Level as Level
from cannjax.core.registry import OpSpec as OpSpec
from cannjax.core.registry import lookup as lookup
from cannjax.core.registry import register as register
from cannjax.core.registry import registry as registry

__all__ = ["EdgeCase", "Level", "OpSpec", "Operator", "defop", "lookup", "register", "registry"]
