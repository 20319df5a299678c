"""Loss-scaled differentiation and an optax wrapper that skips non-finite steps.

A mixed-precision training step in three lines (``opt = amp.skip_nonfinite(...)``)::

    loss_fn = amp.with_policy(model_loss, policy="mixed")     # f32 params, half compute
    loss, grads, loss_scale, finite = amp.value_and_grad(loss_fn, loss_scale)(params, x)
    updates, opt_state = opt.update(grads, opt_state, params, grads_finite=finite)

:func:`value_and_grad` scales the loss, differentiates, checks the *raw* (scaled)
gradients for overflow, unscales them in float32 and adjusts the loss scale.
:func:`skip_nonfinite` wraps any optax optimizer so that a non-finite step changes
nothing: the params (zero update), the inner state, and its step count (so learning-rate
schedules do not advance on skipped steps).

Why the two meet on NaN: on a step flagged as overflowing, :func:`value_and_grad`
returns every gradient leaf as NaN. The flag and the values then never disagree: not
across devices (``axis_name``: a device whose own gradients were finite gets NaN too),
and not on saturation hardware (where the overflow left no inf behind), so
:func:`skip_nonfinite` needs no side channel for the flag. Passing the flag itself
(``grads_finite=``) saves the second check and lets the check's verdict, not the
values, decide: ``cannjax.parallel.data_parallel`` does so with the flag that
:func:`value_and_grad` agreed over the mesh axis.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from cannjax._src.amp.loss_scale import (
    LOSS_SCALE_TYPES,
    LossScale,
    OverflowCheck,
    _floating_map,
    _inverse,
    all_finite,
    default_overflow_check,
    warn_if_stuck,
)
from cannjax._src.core.dtypes import upcast
from cannjax._src.core.platform import facts


class AmpResult(NamedTuple):
    """What :func:`value_and_grad`'s wrapped function returns (a NamedTuple).

    Attributes:
      value: the loss as ``fun`` returned it (not scaled), or ``(loss, aux)`` when
        ``has_aux``, as in ``jax.value_and_grad``.
      grads: unscaled gradients, floating leaves in float32 (float64 stays float64);
        every leaf is NaN when ``grads_finite`` is False.
      loss_scale: the loss scale adjusted for the next step.
      grads_finite: boolean scalar; False when an overflow was detected (on any device
        of ``axis_name``): skip this step.
    """

    value: Any
    grads: Any
    loss_scale: LossScale
    grads_finite: jax.Array


def _check_argnums(argnums: Any) -> None:
    ok_int = lambda a: isinstance(a, (int, np.integer)) and not isinstance(a, bool)  # noqa: E731
    if ok_int(argnums):
        return
    if isinstance(argnums, tuple) and argnums and all(ok_int(a) for a in argnums):
        return
    raise TypeError(
        f"cannjax.amp.value_and_grad: argnums must be an int or a non-empty tuple of ints, "
        f"got {argnums!r}"
    )


def _is_loss_scale_protocol(x: Any) -> bool:
    return all(callable(getattr(x, m, None)) for m in ("scale", "unscale", "adjust"))


def value_and_grad(
    fun: Callable,
    loss_scale: LossScale,
    *,
    has_aux: bool = False,
    argnums: int | tuple[int, ...] = 0,
    axis_name: Hashable | None = None,
    overflow_check: OverflowCheck | None = None,
    warn: bool = False,
) -> Callable[..., AmpResult]:
    """``jax.value_and_grad`` of a loss-scaled ``fun``, with overflow check and adjust.

    For a step with scale ``S``, the wrapped function computes::

        loss, vjp = jax.vjp(fun, *args)                 # fun in its own (half) dtypes
        raw = grad(S * float32(loss))                   # scaled backward
        ok  = overflow_check(raw)                       # on the raw, scaled gradients
        ok  = pmin(ok, axis_name)                       # if given: all devices agree
        grads = float32(raw) * (1/S if ok else nan)     # unscaled in float32
        return AmpResult(loss, grads, loss_scale.adjust(ok), ok)

    This is the loss scaling of Micikevicius et al.: the scale lifts small gradients
    into float16's range for the backward, the update sees them unscaled, and a step
    whose gradients overflowed is skipped while the scale is lowered (the caller skips,
    e.g. with :func:`skip_nonfinite`; ``adjust`` lowers). A loss scale of another
    library that follows only the ``scale``/``unscale``/``adjust`` protocol (jmp's) is
    unscaled by its own method: ``grads = loss_scale.unscale(raw) * (1 if ok else nan)``.

    The overflow check sees the raw gradients because that is where the hardware
    signal is (for saturation mode, ``|g| == 65504`` before unscaling). With
    ``axis_name`` (inside ``shard_map``/``pmap``) the flag is reduced with
    ``lax.pmin``, so every device skips the same steps and adjusts its scale the same
    way. Gradients are not averaged across devices here: that is the data-parallel
    transform's job, and averaging NaN-poisoned gradients stays NaN.

    Clipping: the returned gradients are already unscaled, so any optax clipping that
    follows sees true gradient norms; there is no public function that hands scaled
    gradients to an optimizer (``LossScale.unscale`` is the manual path).

    Args:
      fun: the loss function; returns a floating scalar (or ``(loss, aux)``).
      loss_scale: a :class:`NoOpLossScale`, :class:`StaticLossScale` or
        :class:`DynamicLossScale`: this step's scale (state: pass it through ``jit``);
        or any pytree with ``scale(loss)``, ``unscale(grads)`` and
        ``adjust(grads_finite)`` (the jmp protocol).
      has_aux: ``fun`` returns ``(loss, aux)``.
      argnums: which positional argument(s) to differentiate, as in jax.
      axis_name: a mapped axis name over which the finite flag is agreed.
      overflow_check: ``tree -> bool scalar``; ``None`` means
        :func:`default_overflow_check` for the current platform.
      warn: warn (:class:`LossScaleWarning`, through ``jax.debug.callback`` in a
        ``lax.cond`` branch) when the gradients overflow at the minimum dynamic scale.
        Off by default: the mere presence of a host callback in the compiled step
        slows the whole step down (benchmarks/amp.py, docs/performance.md). Without
        it, the state still carries the flag (``min_scale_overflows``); call
        :func:`check_loss_scale` on the host where you log.

    Returns:
      A function taking ``fun``'s arguments and returning an :class:`AmpResult`
      ``(value, grads, loss_scale, grads_finite)``.

    Raises:
      TypeError: bad ``fun``, ``loss_scale``, ``argnums``, ``overflow_check``, or (at
        trace time) a loss that is not a floating scalar.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from cannjax import amp
      >>> loss = lambda w: jnp.sum((w.astype(jnp.float16) * 1e-4) ** 2).astype(jnp.float32)
      >>> ls = amp.DynamicLossScale()
      >>> value, grads, ls, ok = jax.jit(amp.value_and_grad(loss, ls))(jnp.ones(3))
      >>> grads.dtype.name, bool(ok), float(ls.loss_scale)
      ('float32', True, 32768.0)

    References:
      Micikevicius et al., "Mixed Precision Training", 2018.
      https://arxiv.org/abs/1710.03740
    """
    fn = "cannjax.amp.value_and_grad"
    if not callable(fun):
        raise TypeError(f"{fn}: fun must be callable, got {fun!r}")
    native = isinstance(loss_scale, LOSS_SCALE_TYPES)
    if not (native or _is_loss_scale_protocol(loss_scale)):
        raise TypeError(
            f"{fn}: loss_scale must be a cannjax.amp NoOpLossScale, StaticLossScale or "
            f"DynamicLossScale (or provide scale, unscale and adjust), got "
            f"{type(loss_scale).__name__}; e.g. cannjax.amp.DynamicLossScale() or "
            f"cannjax.amp.StaticLossScale(1024.0)"
        )
    if not isinstance(has_aux, bool):
        raise TypeError(f"{fn}: has_aux must be a bool, got {has_aux!r}")
    _check_argnums(argnums)
    if axis_name is not None and not isinstance(axis_name, Hashable):
        raise TypeError(f"{fn}: axis_name must be hashable (e.g. a str), got {axis_name!r}")
    if overflow_check is None:
        overflow_check = default_overflow_check()
    elif not callable(overflow_check):
        raise TypeError(
            f"{fn}: overflow_check must be a callable tree -> bool scalar, got {overflow_check!r}"
        )

    def scaled_loss(*args, **kwargs):
        out = fun(*args, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(f"{fn}: has_aux=True needs fun to return (loss, aux)")
            loss, aux = out
        else:
            loss, aux = out, None
        dtype = getattr(loss, "dtype", None)
        if (
            dtype is None
            or getattr(loss, "shape", None) != ()
            or not (jnp.issubdtype(dtype, jnp.floating))
        ):
            got = f"{np.dtype(dtype).name}{list(loss.shape)}" if dtype is not None else loss
            raise TypeError(f"{fn}: fun must return a floating scalar loss, got {got!r}")
        return loss_scale.scale(loss), (loss, aux)

    grad_fn = jax.value_and_grad(scaled_loss, argnums=argnums, has_aux=True)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs) -> AmpResult:
        (_, (loss, aux)), raw = grad_fn(*args, **kwargs)
        ok = jnp.asarray(overflow_check(raw))
        if ok.shape != () or ok.dtype != jnp.bool_:
            raise TypeError(
                f"{fn}: overflow_check must return a boolean scalar, got "
                f"{ok.dtype.name}{list(ok.shape)}"
            )
        if axis_name is not None:
            ok = lax.pmin(ok.astype(jnp.int32), axis_name).astype(jnp.bool_)
        # Unscale and poison in one scalar multiply: g * (1/S) if ok, else g * NaN (NaN
        # even for g == 0). It fuses into the optimizer's elementwise update, whereas
        # XLA:CPU materialized a jnp.where over every leaf. 1/S is taken in the gradient's
        # dtype (a float32 reciprocal put float64 gradients off by 3e-8 at S = 3).
        if native:

            def unscale(g):
                g = upcast(g)
                return g * jnp.where(ok, _inverse(loss_scale, g), jnp.nan).astype(g.dtype)

            grads = _floating_map("value_and_grad", unscale, raw)
        else:  # the protocol's own unscale, then the same poisoning
            poison = jnp.where(ok, jnp.float32(1.0), jnp.nan)
            grads = _floating_map(
                "value_and_grad",
                lambda g: g * poison.astype(g.dtype),
                loss_scale.unscale(raw),
            )
        new_scale = loss_scale.adjust(ok)
        if warn:
            warn_if_stuck(new_scale)
        return AmpResult((loss, aux) if has_aux else loss, grads, new_scale, ok)

    return wrapped


class SkipNonFiniteState(NamedTuple):
    """State of :func:`skip_nonfinite`.

    Attributes:
      inner_state: the wrapped optimizer's state (unchanged by a skipped step).
      last_finite: boolean scalar, whether the last step was applied.
      num_skipped: int32, total steps skipped since init.
      consecutive_skipped: int32, steps skipped in a row (0 after an applied step).
    """

    inner_state: Any
    last_finite: jax.Array
    num_skipped: jax.Array
    consecutive_skipped: jax.Array


def skip_nonfinite(
    inner: optax.GradientTransformation,
    *,
    check: OverflowCheck = all_finite,
    mode: str | None = None,
    allow_float16_updates: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax optimizer so that a non-finite step changes nothing.

    ``update(grads, state, params, *, grads_finite=None)``::

        ok = check(grads) if grads_finite is None else grads_finite
        updates, new_inner = inner.update(grads, state.inner_state, params)
        updates   = where(ok, updates, -0.0)          # p + (-0.0) == p, bit for bit
        new_inner = where(ok, new_inner, state.inner_state)   # count not advanced

    Passing ``grads_finite=result.grads_finite`` from :func:`value_and_grad` reuses
    that function's check (over the same gradients) instead of checking again: one
    reduction over the gradients per step instead of two. Only pass it for the
    gradients the flag was computed on (not for gradients accumulated elsewhere).

    The zero update is ``-0.0``, the identity of IEEE addition, so
    ``optax.apply_updates`` leaves every param bit-identical (``+0.0`` would turn a
    ``-0.0`` param into ``+0.0``). Unlike ``optax.apply_if_finite`` a bad update is
    never applied, however many steps in a row are skipped; a stuck run is reported
    by :class:`DynamicLossScale` (``min_scale_overflows``) and visible here in
    ``consecutive_skipped``. The select is a ``jnp.where`` that fuses into the
    optimizer's own elementwise update (no ``lax.cond``: no host sync on GPU).

    Composition:
      * Put it outermost around everything stateful: ``skip_nonfinite(optax.chain(
        optax.clip_by_global_norm(1.0), optax.adam(lr)))``. Clipping inside sees the
        unscaled gradients of :func:`value_and_grad` (clip after unscaling); a
        stateless clip outside is also safe, since clipping an inf gives NaN.
      * Gradient accumulation: ``skip_nonfinite(optax.MultiSteps(opt, k))``, this
        wrapper outside. An overflowing micro-batch is dropped before it reaches the
        accumulator (MultiSteps' state, its mini-step counter included, is left as it
        was), so every effective batch is k finite micro-batches and the inner
        optimizer steps once per effective batch. The other nesting,
        ``MultiSteps(skip_nonfinite(opt), k)``, cannot work: MultiSteps resets its
        accumulator as ``0 * acc`` and ``0 * NaN`` is NaN, so one non-finite
        micro-batch makes every later effective batch non-finite (all skipped;
        ``consecutive_skipped`` keeps growing, which is how to notice it).
      * Wrong order made loud: gradients that were never unscaled are float16 when the
        params are (the scaled backward's dtype), while :func:`value_and_grad` and
        ``LossScale.unscale`` always return float32. A float16 gradient therefore raises
        a TypeError at trace time, unless ``allow_float16_updates=True`` (pure float16
        training without loss scaling).

    Args:
      inner: the optax optimizer to protect.
      check: ``tree -> bool scalar`` applied to the incoming gradients (default
        :func:`all_finite`; they are already unscaled float32 here, so a saturation
        check belongs in :func:`value_and_grad`, not here).
      allow_float16_updates: accept float16 gradients (see above).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is
      :class:`SkipNonFiniteState`; extra keyword arguments go to ``inner``.

    Raises:
      TypeError: ``inner`` is not a GradientTransformation, ``check`` is not callable,
        or (at trace time) float16 gradients arrive.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from cannjax import amp
      >>> opt = amp.skip_nonfinite(optax.sgd(0.1))
      >>> params = jnp.array([1.0, -0.0])
      >>> state = opt.init(params)
      >>> updates, state = opt.update(jnp.array([jnp.inf, 1.0]), state, params)
      >>> optax.apply_updates(params, updates).tolist(), int(state.num_skipped)
      ([1.0, -0.0], 1)
    """
    fn = "cannjax.amp.skip_nonfinite"
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(
            f"{fn}: inner must be an optax GradientTransformation (init, update), got "
            f"{type(inner).__name__}"
        )
    if not callable(check):
        raise TypeError(f"{fn}: check must be a callable tree -> bool scalar, got {check!r}")
    if mode is None:
        mode = facts().skip_mode
    if mode not in ("cond", "select"):
        raise ValueError(f"{fn}: mode must be 'cond', 'select' or None, got {mode!r}")
    if not isinstance(allow_float16_updates, bool):
        raise TypeError(
            f"{fn}: allow_float16_updates must be a bool, got {allow_float16_updates!r}"
        )
    if not isinstance(inner, optax.GradientTransformation):
        inner = optax.GradientTransformation(inner.init, inner.update)
    inner = optax.with_extra_args_support(inner)

    def apply(updates, inner_state, params, extra_args):
        return inner.update(updates, inner_state, params, **extra_args)

    def skipped(updates, inner_state, params, extra_args):
        new_updates, _ = jax.eval_shape(apply, updates, inner_state, params, extra_args)
        neg_zero = lambda s: jnp.full(s.shape, -0.0, s.dtype)  # noqa: E731
        return jax.tree_util.tree_map(neg_zero, new_updates), inner_state

    def _cond_update(ok, updates, state, params, extra_args):
        # Only the taken branch runs: a normal step costs what the inner update costs.
        return lax.cond(ok, apply, skipped, updates, state.inner_state, params, extra_args)

    def _select_update(ok, updates, state, params, extra_args):
        # Both computed, then selected: no host round trip for the predicate (GPU).
        new_updates, new_inner = apply(updates, state.inner_state, params, extra_args)
        new_updates = jax.tree_util.tree_map(
            lambda u: jnp.where(ok, u, jnp.asarray(-0.0, jnp.result_type(u))), new_updates
        )
        new_inner = jax.tree_util.tree_map(
            lambda new, old: jnp.where(ok, new, old).astype(jnp.result_type(old)),
            new_inner,
            state.inner_state,
        )
        return new_updates, new_inner

    def init(params):
        return SkipNonFiniteState(
            inner_state=inner.init(params),
            last_finite=jnp.array(True),
            num_skipped=jnp.zeros((), jnp.int32),
            consecutive_skipped=jnp.zeros((), jnp.int32),
        )

    def update(updates, state, params=None, *, grads_finite=None, **extra_args):
        if not isinstance(state, SkipNonFiniteState):
            raise TypeError(
                f"{fn}: state must come from this transformation's init, got "
                f"{type(state).__name__}; make sure you called init first"
            )
        if not allow_float16_updates:
            for g in jax.tree_util.tree_leaves(updates):
                if jnp.result_type(g) == jnp.float16:
                    raise TypeError(
                        f"{fn}: got float16 gradients; loss-scaled gradients must be "
                        f"unscaled in float32 before the optimizer (and before clipping): "
                        f"use cannjax.amp.value_and_grad, or loss_scale.unscale(grads). "
                        f"For pure float16 training without loss scaling pass "
                        f"allow_float16_updates=True"
                    )
        if grads_finite is None:
            ok = jnp.asarray(check(updates))
            what = "check must return"
        else:  # the flag value_and_grad already computed over these very gradients
            ok = jnp.asarray(grads_finite)
            what = "grads_finite must be"
        if ok.shape != () or ok.dtype != jnp.bool_:
            raise TypeError(f"{fn}: {what} a boolean scalar, got {ok.dtype.name}{list(ok.shape)}")
        if mode == "cond":
            new_updates, new_inner = _cond_update(ok, updates, state, params, extra_args)
        else:
            new_updates, new_inner = _select_update(ok, updates, state, params, extra_args)
        skipped = (~ok).astype(jnp.int32)
        cap = jnp.iinfo(jnp.int32).max - 1
        return new_updates, SkipNonFiniteState(
            inner_state=new_inner,
            last_finite=ok,
            num_skipped=jnp.minimum(state.num_skipped, cap) + skipped,
            consecutive_skipped=jnp.where(ok, 0, jnp.minimum(state.consecutive_skipped, cap) + 1),
        )

    return optax.GradientTransformationExtraArgs(init, update)
