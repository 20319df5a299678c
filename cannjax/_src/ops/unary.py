"""Shared machinery for unary elementwise operators: ``y = f(x)``, ``dy = f'(x) dx``.

Each operator keeps one residual, chosen by its ``saves``: ``"x"`` (the input; the
backward recomputes ``f'(x)``), ``"out"`` (the output, when ``f'`` is a function of ``y``
alone, so the input may be overwritten) or ``"mask"`` (a boolean array, for piecewise
linear ``f``). Half-precision values and derivatives are evaluated in float32 and cast
back once: XLA:CPU would otherwise round every intermediate of ``f`` to the half dtype (a
convert pair per elementwise op: slower, and a rounding error per op instead of one).

Higher orders: the local derivative ``f'`` is itself an operator whose derivative
``f''(x) dx`` is exactly 0 where ``dx`` is 0, even where ``f''`` is infinite (``log`` at
a tiny ``x``), and so on at every order; plain autodiff would give ``inf * 0 = NaN`` in
every off-diagonal entry of a Hessian.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.shard_alike import shard_alike

from cannjax._src.core.dtypes import downcast, upcast
from cannjax._src.core.operator import Operator, defop
from cannjax._src.core.registry import EdgeCase, Level

_LEVEL = {"x": Level.RECOMPUTE, "out": Level.OUTPUT, "mask": Level.DERIVED}
_WHAT = {
    "x": "the input x",
    "out": "the output f(x), which the forward makes anyway",
    "mask": "a boolean mask of where f'(x) = 1",
}


def unary(
    name: str,
    value: Callable[..., jax.Array],
    derivative: Callable[..., jax.Array],
    *,
    saves: str,
    save: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
) -> Operator:
    """Declares ``y = value(x, **kw)`` with ``f'(x) = derivative(saved, **kw)``.

    ``save(x, y)`` computes the residual when ``saves == "mask"``.
    """

    def forward(x, **kw):
        y = downcast(value(upcast(x), **kw), x.dtype)
        saved = {"x": x, "out": y}.get(saves) if save is None else save(x, y)
        return y, {saves: saved}

    def local(res, **kw):
        saved = upcast(res[saves])
        if saves == "mask":
            return derivative(saved, **kw)
        return _derivative_op(name, derivative, tuple(sorted(kw.items())), 0)(saved)

    def tangent(res, t, **kw):
        return _times(local(res, **kw), upcast(t)).astype(t.dtype)

    def backward(res, g, **kw):
        dx = _times(local(res, **kw), upcast(g)).astype(g.dtype)
        return (shard_alike(dx, res[saves])[0],)

    return defop(
        name,
        forward=forward,
        tangent=tangent,
        backward=backward,
        residuals={saves: _WHAT[saves] + ", same shape as x"},
        level=_LEVEL[saves],
        reuse=() if saves == "x" else (0,),
    )


def _times(d: jax.Array, t: jax.Array) -> jax.Array:
    """``d * t``; a boolean ``d`` (a mask) selects ``t`` or 0 in ``t``'s dtype, with no
    bool-float promotion (an error under ``jax.numpy_dtype_promotion("strict")``)."""
    if d.dtype == jnp.bool_:
        return jnp.where(d, t, jnp.zeros((), t.dtype))
    return d * t


def _safe_mul(t: jax.Array, d: jax.Array) -> jax.Array:
    # d is replaced before the product: no 0 * inf NaN is made, even masked.
    return t * jnp.where(t == 0, jnp.zeros((), d.dtype), d)


@functools.cache
def _derivative_op(name: str, derivative: Callable[..., jax.Array], static: tuple, n: int):
    """An operator for the ``n``-th derivative of ``derivative(x, **static)`` (itself ``f'``).

    Its tangent and backward multiply by the next derivative (an operator of the same
    kind, built when an outer transform asks for it) with :func:`_safe_mul`, so every
    order stays on these rules and a zero (co)tangent gives 0 where the next derivative
    is infinite. The ``n``-th derivative is plain autodiff of ``derivative`` along ones.
    """

    def value(x):
        d = functools.partial(derivative, **dict(static))
        for _ in range(n):
            d = functools.partial(lambda g, v: jax.jvp(g, (v,), (jnp.ones_like(v),))[1], d)
        return d(x)

    def next_derivative(res):
        return _derivative_op(name, derivative, static, n + 1)(res["x"])

    return defop(
        f"{name}_d{n + 1}",
        forward=lambda x: (value(x), {"x": x}),
        tangent=lambda res, t: _safe_mul(t, next_derivative(res)),
        backward=lambda res, g: (_safe_mul(g, next_derivative(res)),),
        residuals={"x": "the input x"},
    )


# ------------------------------------------------------------------ samples and edges
def normal(key: jax.Array, shape=(3, 5)) -> tuple:
    """A standard-normal float32 sample of ``shape``."""
    return (jax.random.normal(key, shape, jnp.float32),)


def positive(key: jax.Array, shape=(3, 5), low=0.2, high=3.0) -> tuple:
    """A uniform float32 sample on ``[low, high)``."""
    return (jax.random.uniform(key, shape, jnp.float32, low, high),)


def edge(*values: float, fd: bool = True, ref: bool = True, expected=None, value=None) -> EdgeCase:
    """An edge case on a float32 vector of ``values``.

    ``expected`` is the exact derivative at each value; ``value`` the exact value where
    the reference's is wrong (then the reference is not used for the value).
    """
    # numpy, not jnp: edge cases are built at import time, and creating a jax array there
    # would start the backend before jax.distributed.initialize can run.
    x = np.asarray(values, np.float32)
    exp = None if expected is None else (np.asarray(expected, np.float32),)
    val = None if value is None else np.asarray(value, np.float32)
    return EdgeCase(
        (x,),
        finite_differences=fd,
        reference_value=value is None,
        reference_grad=ref,
        expected_value=val,
        expected_grad=exp,
    )


def edges(*cases: EdgeCase) -> Callable[[], list[EdgeCase]]:
    """The ``edges`` callable of an :class:`~cannjax.core.OpSpec` from fixed cases."""
    return lambda: list(cases)
