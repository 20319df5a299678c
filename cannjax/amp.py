"""Mixed precision and dynamic loss scaling, native to optax.

Policies (which dtype params live in, compute runs in, outputs come back in), loss
scales as immutable pytrees, loss-scaled ``value_and_grad``, an optax wrapper that skips
non-finite steps, per-platform overflow checks, and a plot of the loss scale over a run.
See ``docs/amp.md``.
"""

from cannjax._src.amp.loss_scale import DynamicLossScale as DynamicLossScale
from cannjax._src.amp.loss_scale import LossScale as LossScale
from cannjax._src.amp.loss_scale import LossScaleWarning as LossScaleWarning
from cannjax._src.amp.loss_scale import NoOpLossScale as NoOpLossScale
from cannjax._src.amp.loss_scale import OverflowCheck as OverflowCheck
from cannjax._src.amp.loss_scale import StaticLossScale as StaticLossScale
from cannjax._src.amp.loss_scale import all_finite as all_finite
from cannjax._src.amp.loss_scale import check_loss_scale as check_loss_scale
from cannjax._src.amp.loss_scale import default_overflow_check as default_overflow_check
from cannjax._src.amp.loss_scale import saturation_check as saturation_check
from cannjax._src.amp.plot import plot_loss_scale as plot_loss_scale
from cannjax._src.amp.precision import Policy as Policy
from cannjax._src.amp.precision import cast_floating as cast_floating
from cannjax._src.amp.precision import get_policy as get_policy
from cannjax._src.amp.precision import half_dtype as half_dtype
from cannjax._src.amp.precision import with_policy as with_policy
from cannjax._src.amp.scaled_grad import AmpResult as AmpResult
from cannjax._src.amp.scaled_grad import SkipNonFiniteState as SkipNonFiniteState
from cannjax._src.amp.scaled_grad import skip_nonfinite as skip_nonfinite
from cannjax._src.amp.scaled_grad import value_and_grad as value_and_grad

__all__ = [
    "AmpResult",
    "DynamicLossScale",
    "LossScale",
    "LossScaleWarning",
    "NoOpLossScale",
    "OverflowCheck",
    "Policy",
    "SkipNonFiniteState",
    "StaticLossScale",
    "all_finite",
    "cast_floating",
    "check_loss_scale",
    "default_overflow_check",
    "get_policy",
    "half_dtype",
    "plot_loss_scale",
    "saturation_check",
    "skip_nonfinite",
    "value_and_grad",
    "with_policy",
]
