"""Trace-time input checks with messages that name the function, argument and fix."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _describe(x: Any) -> str:
    dtype = getattr(x, "dtype", None)
    shape = getattr(x, "shape", None)
    if dtype is not None and shape is not None:
        return f"{jnp.dtype(dtype).name}{list(shape)}"
    return type(x).__name__


def as_float(fn: str, arg: str, x: Any) -> jax.Array:
    """Returns ``x`` as a floating-point array or raises TypeError naming ``fn``/``arg``.

    Python scalars become weakly typed float arrays; integer and boolean arrays are
    rejected, since a gradient with respect to them is not defined.
    """
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{fn}: {arg} must be a floating-point array, got a bool")
    if isinstance(x, (int, float)):
        return jnp.asarray(x, dtype=float)
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        try:
            x = jnp.asarray(x)
        except TypeError as e:
            raise TypeError(
                f"{fn}: {arg} must be a floating-point array, got {type(x).__name__}"
            ) from e
        dtype = x.dtype
        if jnp.issubdtype(dtype, jnp.integer):
            return x.astype(float)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{fn}: {arg} must be a floating-point array, got {_describe(x)}; "
            f"cast it first, e.g. {arg}.astype(jnp.float32)"
        )
    return jnp.asarray(x)


def as_int(fn: str, arg: str, x: Any) -> jax.Array:
    """Returns ``x`` as an integer array or raises TypeError naming ``fn``/``arg``."""
    x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{fn}: {arg} must be an integer array, got {_describe(x)}")
    return x


def check_axis(fn: str, axis: Any, ndim: int, arg: str = "axis") -> int:
    """Returns ``axis`` normalized to ``[0, ndim)`` or raises ValueError/TypeError."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{fn}: {arg} must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"{fn}: {arg}={axis} is out of range for an input of rank {ndim}; "
            f"expected {-ndim} <= {arg} < {ndim}"
        )
    return int(axis) % ndim


def dense_operands(
    fn: str, x: Any, w: Any, *, dims: str = "in, out"
) -> tuple[jax.Array, jax.Array]:
    """``x [..., in]`` and ``w [in, out]`` as floating arrays, or ValueError naming ``fn``.

    ``dims`` names the two axes of ``w`` in the message (``"in, out"``, ``"D, V"``).
    """
    x, w = as_float(fn, "x", x), as_float(fn, "w", w)
    first = dims.split(",")[0].strip()
    if x.ndim < 1:
        raise ValueError(f"{fn}: x must have rank >= 1 (shape [..., {first}]), got a scalar")
    if w.ndim != 2 or w.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{fn}: w must have shape ({dims}) with {first} == x.shape[-1] == {x.shape[-1]}, "
            f"got {tuple(w.shape)}"
        )
    return x, w
