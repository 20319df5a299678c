"""Helpers shared by the reduction, loss and safe-gradient operators.

* :func:`reduction`: declares an operator that reduces each row to a scalar from its
  forward and one local-gradient function (``logsumexp``, ``norm``, ``entropy``,
  ``softmax_cross_entropy``), as :func:`cannjax._src.ops.unary.unary` does for
  elementwise operators.
* :func:`float_input`, :func:`axis_of`, :func:`mask_of`, :func:`broadcast_pair`:
  trace-time validation with errors that name the public function and argument.
* :func:`safe_mul`: ``g * d`` that is 0 where ``g`` is 0, so an infinite local derivative
  (``log`` at 0) times a zero cotangent gives 0, not NaN.
* :func:`shifted_exp`, :func:`inv_sum`: the max-shifted forward of the softmax family
  (logsumexp, softmax, log_softmax, softmax_cross_entropy) and the ``1 / s`` they keep;
  :func:`exp_shifted` makes its ``exp(x - m)`` again from a kept ``m``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from cannjax._src.core.dtypes import upcast
from cannjax._src.core.operator import Operator, defop
from cannjax._src.core.registry import Level
from cannjax._src.core.validate import as_inexact, check_axis, promote_inexact


def float_input(fn: str, arg: str, x: Any) -> jax.Array:
    """``x`` as a floating array of rank >= 1, or TypeError/ValueError naming ``fn``.

    Integer and boolean inputs are promoted as ``jnp`` promotes them
    (:func:`~cannjax._src.core.validate.as_inexact`)."""
    x = as_inexact(fn, arg, x)
    if x.ndim == 0:
        raise ValueError(
            f"{fn}: {arg} must have at least one dimension to reduce over, got a scalar "
            f"(shape ()); pass e.g. {arg}[None]"
        )
    return x


def axis_of(fn: str, axis: Any, x: jax.Array) -> int:
    """``axis`` normalized to ``[0, x.ndim)``; clear error if it is out of range."""
    return check_axis(fn, axis, x.ndim)


def mask_of(fn: str, where: Any, x: jax.Array) -> jax.Array:
    """The boolean ``where`` mask broadcast to ``x.shape``, or TypeError/ValueError."""
    where = jnp.asarray(where)
    if where.dtype != jnp.bool_:
        raise TypeError(
            f"{fn}: where must be a boolean array (True = included), got "
            f"{where.dtype.name}{list(where.shape)}; use e.g. where=(mask != 0)"
        )
    try:
        shape = jnp.broadcast_shapes(where.shape, x.shape)
    except ValueError:
        shape = None
    if shape != x.shape:
        raise ValueError(
            f"{fn}: where must broadcast to x.shape={x.shape}, got where.shape={where.shape}"
        )
    return jnp.broadcast_to(where, x.shape)


def broadcast_pair(
    fn: str, names: tuple[str, str], a: Any, b: Any, *, complex_ok: bool = False
) -> tuple[jax.Array, ...]:
    """Two float inputs broadcast to their common shape and promoted to a common dtype.

    Broadcasting and dtype promotion follow ``jnp`` (numpy rules; integer inputs become
    floating as in ``jnp.arctan2``); incompatible shapes raise ValueError. Complex inputs
    raise TypeError unless ``complex_ok``.
    """
    a, b = promote_inexact(fn, names, a, b, complex_ok=complex_ok)
    try:
        shape = jnp.broadcast_shapes(a.shape, b.shape)
    except ValueError:
        raise ValueError(
            f"{fn}: {names[0]} and {names[1]} must have broadcast-compatible shapes, got "
            f"{names[0]}.shape={a.shape} and {names[1]}.shape={b.shape}"
        ) from None
    return jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)


def safe_mul(g: jax.Array, d: jax.Array) -> jax.Array:
    """``g * d``, but exactly 0 where ``g == 0`` (even if ``d`` is infinite). ``d`` is
    replaced there before the product, so no ``0 * inf`` NaN is made (jax.debug_nans)."""
    return g * jnp.where(g == 0, jnp.zeros((), d.dtype), d)


def shifted_exp(
    x: jax.Array, where: jax.Array | None, axis: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(z, m, e, s)`` of a softmax over ``axis``, the max subtracted before ``exp``.

    ``m`` is the row max (axis kept) of ``x`` with the entries where ``where`` is False
    set to ``-inf``; ``z = x - m`` (``-inf`` at masked entries), ``e = exp(z)`` (0 there)
    and ``s = sum(e)`` over ``axis`` (kept). No upcast: pass ``upcast(x)``.

    ``m`` is 0 for a row with no finite maximum (all ``-inf`` or fully masked), so ``z``
    is never ``-inf - (-inf)``: such a row has ``e = 0`` and ``s = 0``. A row holding
    ``+inf`` has ``m = +inf`` and ``z = 0`` at its ``+inf`` entries, ``-inf`` elsewhere
    (the limit of ``x - max(x)`` as those entries grow together), never ``inf - inf``:
    its softmax is uniform over the ``+inf`` entries. A NaN anywhere in a row makes its
    ``s`` NaN. The max is a constant of the math (it cancels), so it gets no gradient.
    """
    if where is not None:
        x = jnp.where(where, x, -jnp.inf)
    # initial=-inf: a zero-size axis reduces to -inf (an empty row), not an error.
    top = jax.lax.stop_gradient(jnp.max(x, axis, keepdims=True, initial=-jnp.inf))
    m = jnp.where(jnp.isfinite(top), top, jnp.zeros((), top.dtype))
    z = minus_max(x, top)
    e = jnp.exp(z)
    return z, jnp.where(top == jnp.inf, top, m), e, jnp.sum(e, axis, keepdims=True)


@jax.custom_jvp
def minus_max(x: jax.Array, top: jax.Array) -> jax.Array:
    """``x - top`` (``top`` the row max), taken as 0 at ``+inf`` entries of a ``+inf``
    row, and ``x`` itself in a row with no finite max."""
    # x - m, with m = top at +inf: finite - inf is already -inf; only inf - inf would
    # be NaN, so those entries subtract 0 from 0. No inf or NaN is made that x lacks
    # (jax.debug_nans and debug_infs see every value of a backward).
    m = jnp.where(jnp.isfinite(top) | (top == jnp.inf), top, jnp.zeros((), top.dtype))
    both = (x == jnp.inf) & (m == jnp.inf)
    zero = jnp.zeros((), x.dtype)
    return jnp.where(both, zero, x) - jnp.where(both, zero, m)


@minus_max.defjvp
def minus_max_jvp(primals, tangents):
    # dz = dx everywhere, the max being a constant of the math. At a +inf entry this is
    # the tangent of x - max(x) as the +inf entries grow together, so second derivatives
    # there are the limit's (a plain where would give them 0).
    x, top = primals
    return minus_max(x, top), tangents[0]


def exp_shifted(x: jax.Array, m: jax.Array) -> jax.Array:
    """``e`` of :func:`shifted_exp` again, from ``x`` and the ``m`` it returned (kept as a
    residual): ``exp(x - m)``, 1 at the ``+inf`` entries of a ``+inf`` row (where ``m`` is
    ``+inf``) and 0 at its other entries, ``exp(x)`` in a row with no finite max (``m``
    is 0 there). ``m`` gets no tangent, as in :func:`shifted_exp`."""
    return jnp.exp(minus_max(x, m))


def inv_sum(s: jax.Array) -> jax.Array:
    """``1 / s`` per row, 0 for an empty row (``s = 0``): its softmax is taken as 0.
    NaN stays NaN."""
    empty = s == 0
    return jnp.where(empty, jnp.zeros((), s.dtype), 1 / jnp.where(empty, 1, s))


def reduction(
    name: str,
    forward: Callable[..., tuple[jax.Array, dict]],
    local_grad: Callable[[Mapping[str, jax.Array]], jax.Array],
    *,
    zero_safe: bool = False,
    residuals: Mapping[str, str],
    level: Level,
    reuse: Sequence[int] = (),
    nondiff_argnums: Sequence[int] = (),
) -> Operator:
    """Declares an operator that reduces each row of its first argument to a scalar.

    ``forward(x, *rest, **static) -> (y, residuals)`` gives ``y`` (``x``'s shape without
    the reduced axis) and what the backward keeps. ``local_grad(residuals)`` is the local
    gradient ``J = dy/dx`` of each row, of ``x``'s shape (or broadcastable to it), in the
    compute dtype. Both rules follow from it:

    * tangent: ``dy = sum(J * dx, axis)``;
    * backward: ``dx = expand_dims(dy, axis) * J``.

    The reduced axis is the static keyword argument ``axis``, or the last axis for an
    operator without one. With ``zero_safe`` the products are :func:`safe_mul`: a zero
    (co)tangent gives 0 even where ``J`` is infinite (``entropy`` at ``p = 0``). Only
    ``x`` is differentiated: the other arguments (a mask, labels) belong in
    ``nondiff_argnums``. The remaining keyword arguments go to
    :func:`~cannjax.core.defop`.
    """
    mul = safe_mul if zero_safe else operator.mul

    def tangent(res, t, **static):
        axis = static.get("axis", -1)
        return jnp.sum(mul(upcast(t), local_grad(res)), axis).astype(t.dtype)

    def backward(res, g, **static):
        axis = static.get("axis", -1)
        return (mul(jnp.expand_dims(upcast(g), axis), local_grad(res)).astype(g.dtype),)

    return defop(
        name,
        forward=forward,
        tangent=tangent,
        backward=backward,
        nondiff_argnums=nondiff_argnums,
        residuals=residuals,
        level=level,
        reuse=reuse,
    )
