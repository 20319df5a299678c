"""Loss scales as immutable pytrees, and per-platform gradient overflow checks.

Float16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the loss
by a scale ``S`` multiplies every gradient by ``S`` (the chain rule is linear), lifting
small gradients into range; dividing the gradients by ``S`` afterwards, in float32,
restores their value. Too large an ``S`` overflows; a dynamic scale finds the largest
``S`` that does not.

Three loss scales share one interface (``scale``, ``unscale``, ``adjust`` and the
``loss_scale`` value): :class:`NoOpLossScale`, :class:`StaticLossScale` and
:class:`DynamicLossScale`. Each is a frozen dataclass registered with
``jax.tree_util.register_dataclass``: the scale and the counters are pytree leaves (they
travel through ``jit``, ``lax.scan``, checkpoints), the hyperparameters are static
metadata (kept in the treedef, so they survive ``jit`` too, and changing one recompiles).

An overflow check is a function ``check(grads) -> bool scalar`` (True: no overflow).
:func:`all_finite` is the IEEE check; :func:`saturation_check` is for hardware in
saturation mode (Ascend 910A), where an overflow becomes +-65504 instead of inf;
:func:`default_overflow_check` picks per platform, by the platform's overflow mode
(``cannjax.backend.facts().overflow_mode``: ``"saturation"`` on the configured Ascend platform).

References:
  Micikevicius et al., "Mixed Precision Training", 2018. https://arxiv.org/abs/1710.03740
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cannjax._src.core.dtypes import upcast
from cannjax._src.core.platform import _facts

T = TypeVar("T")


class OverflowCheck(Protocol):
    """An overflow check: ``check(grads) -> bool scalar``, True when nothing overflowed.

    Any callable of that shape can be passed as ``overflow_check`` to
    :func:`cannjax.amp.value_and_grad` (e.g. a backend's float-status-register read).
    """

    def __call__(self, tree: Any) -> jax.Array: ...


_F32_MAX = float(np.finfo(np.float32).max)


class LossScaleWarning(RuntimeWarning):
    """Warned when gradients overflow even at the minimum loss scale.

    Skipping such steps will not recover: the forward pass (or the unscaled backward)
    itself produces inf/NaN. Escalate it to an error with
    ``warnings.simplefilter("error", cannjax.amp.LossScaleWarning)``.
    """


# ----------------------------------------------------------------------- validation
def _is_tracer_like(x: Any) -> bool:
    # Unflattening inside transformations hands __post_init__ tracers, abstract values
    # or sentinels; those are never validated or converted (see the jax pytree docs).
    return not isinstance(x, (int, float, np.ndarray, np.generic, jax.Array)) or isinstance(
        x, jax.core.Tracer
    )


def _scale_leaf(cls: str, arg: str, x: Any) -> Any:
    """Validates a concrete scale value and stores it as a float32 scalar array."""
    fn = f"cannjax.amp.{cls}"
    if isinstance(x, (bool, np.bool_, str, bytes)):
        raise TypeError(f"{fn}: {arg} must be a positive float, got {x!r}")
    if _is_tracer_like(x):
        return x
    if isinstance(x, (int, float, np.ndarray, np.generic)):
        arr = np.asarray(x)
        if not (jnp.issubdtype(arr.dtype, jnp.floating) or jnp.issubdtype(arr.dtype, jnp.integer)):
            raise TypeError(f"{fn}: {arg} must be a positive float, got dtype {arr.dtype}")
        # Any shape is accepted (stacked states of an ensemble); every value must be > 0.
        if not np.all(np.isfinite(arr) & (arr > 0)):
            raise ValueError(f"{fn}: {arg} must be finite and > 0, got {arr}")
        return jnp.asarray(arr, jnp.float32)
    # A concrete jax.Array: check dtype and shape only (reading its value would sync the
    # device on every unflatten of a jit output).
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{fn}: {arg} must be a floating scalar, got {x.dtype.name}; "
            f"pass e.g. jnp.float32({arg})"
        )
    # float16/bfloat16 scales overflow at 65504 / lose precision: keep the scale in f32.
    return x if x.dtype == jnp.float32 else x.astype(jnp.float32)


def _count_leaf(cls: str, arg: str, x: Any) -> Any:
    fn = f"cannjax.amp.{cls}"
    if isinstance(x, (bool, np.bool_, str, bytes)):
        raise TypeError(f"{fn}: {arg} must be a non-negative int, got {x!r}")
    if _is_tracer_like(x):
        return x
    dtype = np.asarray(x).dtype if not isinstance(x, jax.Array) else x.dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{fn}: {arg} must be an integer, got dtype {dtype}")
    if isinstance(x, jax.Array):
        return x if x.dtype == jnp.int32 else x.astype(jnp.int32)
    arr = np.asarray(x)
    if np.any(arr < 0):
        raise ValueError(f"{fn}: {arg} must be >= 0, got {arr}")
    return jnp.asarray(arr, jnp.int32)


def _static_message(fn: str, arg: str, kind: str, x: Any) -> str:
    # Hyperparameters are static metadata: they live in the pytree's treedef (so they
    # survive jit and a change recompiles) and adjust() reads them in Python.
    what = "a jax array" if isinstance(x, jax.Array) else type(x).__name__
    return (
        f"{fn}: {arg} must be a Python {kind}, got {what} ({x!r}); it is a static "
        f"hyperparameter, kept in the pytree structure rather than as a leaf, so it cannot "
        f"be an array or a traced value. Pass {kind}(value) (a concrete number)"
    )


def _positive_float(cls: str, arg: str, x: Any, *, allow_inf: bool = False) -> float:
    fn = f"cannjax.amp.{cls}"
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(_static_message(fn, arg, "float", x))
    value = float(x)
    if not value > 0 or (not allow_inf and not np.isfinite(value)):
        raise ValueError(f"{fn}: {arg} must be finite and > 0, got {value}")
    return value


# ----------------------------------------------------------------------- shared ops
def _floating_map(fn_name: str, f: Callable, tree: Any) -> Any:
    def one(x):
        dtype = getattr(x, "dtype", None)
        if dtype is None:
            x = jnp.asarray(x)
            dtype = x.dtype
        if dtype == jax.dtypes.float0:
            return x  # the zero cotangent of an integer input: nothing to scale
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"cannjax.amp.{fn_name}: every leaf must be floating, got {np.dtype(dtype).name}"
            )
        return f(x)

    return jax.tree_util.tree_map(one, tree)


class LossScale:
    """Base class of the loss scales: ``scale``, ``unscale``, ``adjust``, ``loss_scale``.

    Subclasses: :class:`NoOpLossScale`, :class:`StaticLossScale`,
    :class:`DynamicLossScale`; ``isinstance(x, LossScale)`` tells a cannjax loss scale.
    """

    loss_scale: Any

    def adjust(self, grads_finite: jax.typing.ArrayLike) -> LossScale:
        """The loss scale for the next step, given whether this step was finite."""
        raise NotImplementedError

    def scale(self, tree: T) -> T:
        """Multiplies the floating leaves of ``tree`` (the loss) by the loss scale.

        The product is formed in float32 (or wider), so the scaled loss itself never
        overflows; the half-precision part of the backward then receives the scaled
        cotangent.
        """
        s = jnp.asarray(self.loss_scale, jnp.float32)
        return _floating_map("scale", lambda x: upcast(x) * s.astype(upcast(x).dtype), tree)

    def unscale(self, tree: T) -> T:
        """Divides the floating leaves of ``tree`` (the gradients) by the loss scale.

        Leaves are first cast to float32 (float64 stays float64), so small half-precision
        gradients come back as normal float32 numbers, and multiplied by the reciprocal of
        the scale taken in that dtype: exact for power-of-two scales (the scales
        :class:`DynamicLossScale` produces with its default factors), within one rounding
        otherwise. (A true division is no better on XLA:CPU, which also rounds ``g / S``
        differently from IEEE division for about a third of float32 values at ``S = 3``.)
        """
        return _floating_map("unscale", lambda x: upcast(x) * _inverse(self, upcast(x)), tree)


def _inverse(loss_scale: LossScale, like: jax.Array) -> jax.Array:
    """``1 / loss_scale`` computed in ``like``'s dtype (the scale is held in float32)."""
    return 1 / _scale_as(loss_scale, like)


def _scale_as(loss_scale: LossScale, like: jax.Array) -> jax.Array:
    """The loss scale in ``like``'s dtype (it is held in float32; widening is exact)."""
    return jnp.asarray(loss_scale.loss_scale, jnp.float32).astype(like.dtype)


def _check_finite_flag(cls: str, grads_finite: Any) -> jax.Array:
    flag = jnp.asarray(grads_finite)
    if flag.shape != () or flag.dtype != jnp.bool_:
        raise TypeError(
            f"cannjax.amp.{cls}.adjust: grads_finite must be a boolean scalar, got "
            f"{flag.dtype.name}{list(flag.shape)}; reduce it first, e.g. jnp.all(...)"
        )
    return flag


# ----------------------------------------------------------------------- loss scales
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NoOpLossScale(LossScale):
    """A loss scale of 1 that never changes (float32/bfloat16 training).

    Example:
      >>> import jax.numpy as jnp
      >>> from cannjax import amp
      >>> ls = amp.NoOpLossScale()
      >>> float(ls.scale(jnp.float32(3.0))), ls.adjust(jnp.array(False)) is ls
      (3.0, True)
    """

    @property
    def loss_scale(self) -> jax.Array:
        """The constant scale, ``1.0`` in float32."""
        return jnp.ones((), jnp.float32)

    def scale(self, tree: T) -> T:
        """Returns the floating leaves of ``tree`` in float32 (or wider), unscaled."""
        return _floating_map("scale", upcast, tree)

    def unscale(self, tree: T) -> T:
        """Returns the floating leaves of ``tree`` in float32 (or wider)."""
        return _floating_map("unscale", upcast, tree)

    def adjust(self, grads_finite: jax.typing.ArrayLike) -> NoOpLossScale:
        """Returns ``self``: there is nothing to adjust."""
        _check_finite_flag("NoOpLossScale", grads_finite)
        return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StaticLossScale(LossScale):
    """A fixed loss scale.

    The loss is multiplied by ``loss_scale`` before differentiation and the gradients
    divided by it afterwards; a scale chosen too large makes every step overflow (and be
    skipped), one too small leaves small float16 gradients flushed to zero.

    Attributes:
      loss_scale: the factor, a float32 scalar (> 0; a pytree leaf).

    Raises:
      ValueError: if ``loss_scale`` is not finite and > 0.
      TypeError: if ``loss_scale`` is not a float.

    Example:
      >>> import jax.numpy as jnp
      >>> from cannjax import amp
      >>> ls = amp.StaticLossScale(1024.0)
      >>> float(ls.scale(jnp.float32(2.0))), float(ls.unscale(jnp.float32(2048.0)))
      (2048.0, 2.0)

    References:
      Micikevicius et al., "Mixed Precision Training", 2018.
      https://arxiv.org/abs/1710.03740
    """

    loss_scale: Any

    def __post_init__(self):
        object.__setattr__(
            self, "loss_scale", _scale_leaf("StaticLossScale", "loss_scale", self.loss_scale)
        )

    def adjust(self, grads_finite: jax.typing.ArrayLike) -> StaticLossScale:
        """Returns ``self``: a static scale never changes."""
        _check_finite_flag("StaticLossScale", grads_finite)
        return self


def _static(default: Any) -> Any:
    return dataclasses.field(default=default, metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DynamicLossScale(LossScale):
    """The largest loss scale that keeps gradients finite, found while training.

    Algorithm (``adjust``, once per step, after the overflow check)::

        # state: loss_scale, counter (finite steps since the last change),
        #        min_scale_overflows (consecutive overflowing steps at the minimum scale)
        if grads_finite:
            counter += 1
            if counter == growth_interval:              # exactly every growth_interval
                loss_scale = min(loss_scale * growth_factor, max_loss_scale)  # never inf
                counter = 0
            min_scale_overflows = 0
        else:                                           # the step is skipped
            if loss_scale <= min_loss_scale:            # overflow even at the minimum
                min_scale_overflows += 1                #   -> flagged and warned
            else:
                min_scale_overflows = 0
            loss_scale = max(loss_scale * backoff_factor, min_loss_scale)  # never below
            counter = 0

    Defaults (those of PyTorch's GradScaler, with MindSpore's 2**24 cap):
    ``loss_scale=2**15`` (initial), ``growth_factor=2``, ``backoff_factor=0.5``,
    ``growth_interval=2000``, ``min_loss_scale=1``, ``max_loss_scale=2**24``. With
    power-of-two factors the scale stays a power of two, so scaling and unscaling are
    exact.

    Attributes:
      loss_scale: the current scale (float32 scalar leaf).
      counter: finite steps since the scale last changed (int32 scalar leaf).
      min_scale_overflows: consecutive steps that overflowed at ``min_loss_scale``
        (int32 scalar leaf); non-zero means the forward pass itself overflows, see
        :attr:`overflowed_at_min` and :func:`check_loss_scale`.
      growth_interval: finite steps between growths (static, int >= 1).
      growth_factor: growth multiplier (static, > 1).
      backoff_factor: shrink multiplier on overflow (static, in (0, 1)).
      min_loss_scale: lower bound (static, > 0).
      max_loss_scale: upper bound (static, finite, >= min_loss_scale).

    Raises:
      ValueError: scales <= 0 or out of [min, max], growth_factor <= 1, backoff_factor
        not in (0, 1), growth_interval < 1.
      TypeError: a non-numeric argument.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from cannjax import amp
      >>> ls = amp.DynamicLossScale(8.0, growth_interval=2, min_loss_scale=2.0)
      >>> ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))
      >>> float(ls.loss_scale)
      16.0
      >>> ls = jax.jit(lambda s: s.adjust(jnp.array(False)))(ls)
      >>> float(ls.loss_scale), ls.min_loss_scale
      (8.0, 2.0)

    References:
      Micikevicius et al., "Mixed Precision Training", 2018.
      https://arxiv.org/abs/1710.03740 (loss scaling, and skipping the weight update
      of a step whose gradients overflowed)
    """

    loss_scale: Any = 2.0**15
    counter: Any = 0
    min_scale_overflows: Any = 0
    growth_interval: int = _static(2000)
    growth_factor: float = _static(2.0)
    backoff_factor: float = _static(0.5)
    min_loss_scale: float = _static(1.0)
    max_loss_scale: float = _static(2.0**24)

    def __post_init__(self):
        cls = "DynamicLossScale"
        fn = f"cannjax.amp.{cls}"
        gi = self.growth_interval
        if isinstance(gi, bool) or not isinstance(gi, (int, np.integer)):
            raise TypeError(_static_message(fn, "growth_interval", "int", gi))
        if gi < 1:
            raise ValueError(f"{fn}: growth_interval must be >= 1, got {gi}")
        gf = _positive_float(cls, "growth_factor", self.growth_factor)
        if not gf > 1:
            raise ValueError(f"{fn}: growth_factor must be > 1, got {gf}")
        bf = _positive_float(cls, "backoff_factor", self.backoff_factor)
        if not 0 < bf < 1:
            raise ValueError(f"{fn}: backoff_factor must be in (0, 1), got {bf}")
        lo = _positive_float(cls, "min_loss_scale", self.min_loss_scale)
        hi = _positive_float(cls, "max_loss_scale", self.max_loss_scale)
        if hi > _F32_MAX:
            raise ValueError(f"{fn}: max_loss_scale must be <= float32 max, got {hi}")
        if lo > hi:
            raise ValueError(
                f"{fn}: min_loss_scale={lo} must be <= max_loss_scale={hi}; "
                f"lower min_loss_scale or raise max_loss_scale"
            )
        for name, v in (
            ("growth_interval", int(gi)),
            ("growth_factor", gf),
            ("backoff_factor", bf),
            ("min_loss_scale", lo),
            ("max_loss_scale", hi),
        ):
            object.__setattr__(self, name, v)
        scale = _scale_leaf(cls, "loss_scale", self.loss_scale)
        if isinstance(self.loss_scale, (int, float, np.ndarray, np.generic)):
            value = np.asarray(self.loss_scale)
            if not np.all((lo <= value) & (value <= hi)):
                raise ValueError(
                    f"{fn}: loss_scale={value} must lie in [min_loss_scale, max_loss_scale]"
                    f" = [{lo}, {hi}]"
                )
        object.__setattr__(self, "loss_scale", scale)
        object.__setattr__(self, "counter", _count_leaf(cls, "counter", self.counter))
        object.__setattr__(
            self,
            "min_scale_overflows",
            _count_leaf(cls, "min_scale_overflows", self.min_scale_overflows),
        )

    @property
    def overflowed_at_min(self) -> jax.Array:
        """Bool scalar: the last step overflowed although the scale was at its minimum."""
        return jnp.asarray(self.min_scale_overflows) > 0

    def adjust(self, grads_finite: jax.typing.ArrayLike) -> DynamicLossScale:
        """The next loss scale, given whether this step's gradients were finite.

        See the class docstring for the algorithm. Pure: returns a new object.

        Args:
          grads_finite: boolean scalar, True when no overflow was detected.

        Returns:
          The adjusted :class:`DynamicLossScale` (same static hyperparameters).

        Raises:
          TypeError: if ``grads_finite`` is not a boolean scalar.
        """
        finite = _check_finite_flag("DynamicLossScale", grads_finite)
        scale = jnp.asarray(self.loss_scale, jnp.float32)
        counter = jnp.asarray(self.counter, jnp.int32) + 1
        grow = counter >= self.growth_interval
        # min(.) after the product: scale * growth_factor may round to inf in float32.
        grown = jnp.minimum(scale * jnp.float32(self.growth_factor), self.max_loss_scale)
        backed = jnp.maximum(scale * jnp.float32(self.backoff_factor), self.min_loss_scale)
        new_scale = jnp.where(finite, jnp.where(grow, grown, scale), backed)
        new_counter = jnp.where(finite & ~grow, counter, 0).astype(jnp.int32)
        at_min = scale <= jnp.float32(self.min_loss_scale)
        overflows = jnp.asarray(self.min_scale_overflows, jnp.int32)
        # Saturating increment: the count never wraps to a negative int32.
        bumped = jnp.minimum(overflows, jnp.iinfo(jnp.int32).max - 1) + 1
        new_overflows = jnp.where(~finite & at_min, bumped, 0).astype(jnp.int32)
        return dataclasses.replace(
            self, loss_scale=new_scale, counter=new_counter, min_scale_overflows=new_overflows
        )


LOSS_SCALE_TYPES = (NoOpLossScale, StaticLossScale, DynamicLossScale)


# ----------------------------------------------------------------------- overflow checks
def all_finite(tree: Any) -> jax.Array:
    """True when every floating leaf of ``tree`` is finite (no inf, no NaN).

    The default overflow check (IEEE hardware: cpu, gpu, tpu, Ascend 910B in INF/NaN
    mode). Non-floating leaves are ignored.

    Args:
      tree: a pytree of arrays (the gradients).

    Returns:
      A boolean scalar.

    Example:
      >>> import jax.numpy as jnp
      >>> from cannjax import amp
      >>> bool(amp.all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
      False
    """
    return _reduce_ok(tree, _finite)


def _finite(x: jax.Array) -> jax.Array:
    # reduce(and, isfinite(x)). Measured alternatives on XLA:CPU: isfinite(sum(x * 0))
    # compiled to more memory traffic, and max(|x|) < inf is unsafe: its vectorized CPU
    # reduction dropped a NaN in a 2-D array.
    return jnp.all(jnp.isfinite(x))


def _reduce_ok(tree: Any, per_leaf: Callable[[jax.Array], jax.Array]) -> jax.Array:
    oks = [
        per_leaf(x)
        for x in jax.tree_util.tree_leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.floating)
    ]
    if not oks:
        return jnp.array(True)
    return jnp.all(jnp.stack(oks))


def saturation_check(dtype: Any = "float16") -> OverflowCheck:
    """An overflow check for saturation-mode hardware (Ascend 910A).

    In saturation mode an overflowing float16 result becomes ``+-65504`` (the dtype's
    largest finite value) instead of ``inf``, so :func:`all_finite` misses it. This
    check flags ``|g| >= finfo(dtype).max`` as well as inf and NaN: it is
    ``all(|g| < finfo(dtype).max)`` over every floating leaf, whatever the leaf's own
    dtype (the gradient of a float32 param cast to float16 is a float16 cotangent
    converted to float32, so a saturated ``65504.0`` arrives in float32).

    Caveats: (1) saturation hardware also turns NaN into 0, and a zero is a valid
    gradient: an ``inf - inf`` or ``0/0`` inside the backward cannot be detected from the
    values at all. MindSpore reads the NPU's float-status register for that; a backend
    that can read it should pass its own check (any ``tree -> bool scalar`` callable) as
    ``overflow_check``. (2) A legitimate gradient ``>= 65504`` of a param computed in
    float32 is flagged too; that only halves the loss scale once more (harmless).

    Args:
      dtype: the compute dtype whose maximum marks saturation (float16 by default).

    Returns:
      ``check(tree) -> bool scalar`` (True: no overflow).

    Raises:
      TypeError: if ``dtype`` is not floating.

    Example:
      >>> import jax.numpy as jnp
      >>> from cannjax import amp
      >>> check = amp.saturation_check("float16")
      >>> bool(check(jnp.array([1.0, 65504.0]))), bool(check(jnp.array([1.0, 60000.0])))
      (False, True)
    """
    from cannjax._src.amp.precision import _as_float_dtype

    dt = _as_float_dtype("cannjax.amp.saturation_check", "dtype", dtype)
    limit = float(jnp.finfo(dt).max)

    def per_leaf(x: jax.Array) -> jax.Array:
        # False where |x| >= limit, and for NaN (every comparison with NaN is False).
        return jnp.all(jnp.abs(x) < jnp.asarray(limit, x.dtype))

    def check(tree: Any) -> jax.Array:
        return _reduce_ok(tree, per_leaf)

    check.__name__ = check.__qualname__ = f"saturation_check_{dt.name}"
    check.__doc__ = f"True when every |g| < {limit} (the {dt.name} maximum) and no NaN."
    return check


def default_overflow_check(platform: str | None = None) -> OverflowCheck:
    """The overflow check for a platform, chosen by its overflow mode.

    ``cannjax.backend.facts(platform).overflow_mode`` decides: ``"isfinite"`` (every platform
    but Ascend) gives :func:`all_finite`; ``"saturation"`` (the configured Ascend
    platform, ``cannjax.backend.ascend.config().platform``) gives
    ``saturation_check("float16")``, which catches inf and NaN too, so it is right for
    both the 910A (saturation mode) and the 910B (INF/NaN mode).

    Args:
      platform: a platform name; ``None`` means ``jax.default_backend()``.

    Returns:
      An overflow check ``tree -> bool scalar`` (True: no overflow).

    Raises:
      TypeError: if ``platform`` is neither a non-empty string nor None.

    Example:
      >>> import jax.numpy as jnp
      >>> from cannjax import amp
      >>> amp.default_overflow_check("cpu") is amp.all_finite
      True
      >>> saturated = {"w": jnp.array([1.0, 65504.0], jnp.float16)}  # float16's maximum
      >>> bool(amp.default_overflow_check("ascend")(saturated))
      False
    """
    mode = _facts("cannjax.amp.default_overflow_check", platform).overflow_mode
    if mode == "saturation":
        return saturation_check("float16")
    return all_finite


# ----------------------------------------------------------------------- reporting
def _stuck_message(count: Any, scale: Any) -> str:
    return (
        f"cannjax.amp: gradients overflowed at the minimum loss scale ({float(scale):g}) "
        f"for {int(count)} consecutive step(s); these steps are skipped, and lowering the "
        f"scale further cannot help. The forward pass or the unscaled backward itself "
        f"produces inf/NaN: find it with cannjax.health / jax.debug_nans, keep that op in "
        f"float32 (policy output=float32), or lower the learning rate."
    )


def _emit_stuck_warning(count: Any, scale: Any) -> None:
    warnings.warn(_stuck_message(count, scale), LossScaleWarning, stacklevel=2)


def warn_if_stuck(loss_scale: Any) -> None:
    """Inside jit: warn (host callback) when ``min_scale_overflows`` hits 1, 2, 4, 8...

    The callback sits in a ``lax.cond`` branch, so a normal step pays no host round
    trip. Only :class:`DynamicLossScale` can be stuck.
    """
    if not isinstance(loss_scale, DynamicLossScale):
        return
    count = jnp.asarray(loss_scale.min_scale_overflows, jnp.int32)
    power_of_two = (count > 0) & ((count & (count - 1)) == 0)

    def emit(c, s):
        jax.debug.callback(_emit_stuck_warning, c, s)

    lax.cond(power_of_two, emit, lambda c, s: None, count, loss_scale.loss_scale)


def check_loss_scale(loss_scale: LossScale, *, strict: bool = False) -> dict[str, Any]:
    """Host-side health check of a loss scale; warns (or raises) if it is stuck.

    Call it outside ``jit`` (e.g. every N steps, next to logging). A
    :class:`DynamicLossScale` whose ``min_scale_overflows > 0`` is stuck: the gradients
    overflow even at ``min_loss_scale``.

    Args:
      loss_scale: a loss scale with concrete values.
      strict: raise ``FloatingPointError`` instead of warning.

    Returns:
      ``{"loss_scale": float, "counter": int, "min_scale_overflows": int,
      "stuck": bool}`` (counters are 0 for static scales).

    Raises:
      TypeError: if ``loss_scale`` is not a cannjax loss scale.
      FloatingPointError: if stuck and ``strict``.

    Example:
      >>> from cannjax import amp
      >>> amp.check_loss_scale(amp.DynamicLossScale(4.0))["stuck"]
      False
    """
    if not isinstance(loss_scale, LOSS_SCALE_TYPES):
        raise TypeError(
            f"cannjax.amp.check_loss_scale: loss_scale must be a cannjax.amp loss scale, "
            f"got {type(loss_scale).__name__}"
        )
    report = {
        "loss_scale": float(loss_scale.loss_scale),
        "counter": int(getattr(loss_scale, "counter", 0)),
        "min_scale_overflows": int(getattr(loss_scale, "min_scale_overflows", 0)),
    }
    report["stuck"] = report["min_scale_overflows"] > 0
    if report["stuck"]:
        msg = _stuck_message(report["min_scale_overflows"], report["loss_scale"])
        if strict:
            raise FloatingPointError(msg)
        warnings.warn(msg, LossScaleWarning, stacklevel=2)
    return report
