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


def inexact_dtype(dtype: Any) -> np.dtype:
    """The inexact dtype ``jnp`` promotes ``dtype`` to (``jnp.exp``, ``jax.nn.gelu``).

    Floating and complex dtypes stay; 64-bit integers become float64, other integers and
    bool float32 (then canonicalized: float32 without x64).
    """
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return dtype
    wide = jnp.issubdtype(dtype, jnp.integer) and dtype.itemsize == 8
    return jnp.dtype(jax.dtypes.canonicalize_dtype(np.float64 if wide else np.float32))


def as_inexact(fn: str, arg: str, x: Any) -> jax.Array:
    """``x`` as a floating array, promoted as ``jax.nn`` and ``jnp`` promote it.

    For the operators with a ``jax.nn``, ``jax.scipy.special``, ``jnp`` or optax
    counterpart. Integer and boolean arrays become :func:`inexact_dtype` (int32 -> float32,
    int64 -> float64); a weakly typed input (a Python scalar) stays weakly typed, so
    ``op(2.0) * bf16_array`` stays bfloat16 as with ``jnp``. As in ``jax.nn``, lists and
    tuples are not converted implicitly (TypeError). Complex inputs are rejected.
    """
    return promote_inexact(fn, (arg,), x)[0]


def promote_inexact(
    fn: str, args: tuple[str, ...], *xs: Any, complex_ok: bool = False
) -> list[jax.Array]:
    """``xs`` promoted together to one floating dtype, as ``jnp.arctan2`` promotes them.

    The common dtype is ``jnp.result_type`` of the inputs, made floating with
    :func:`inexact_dtype` (int32 with float16 gives float16, two int32 arrays float32). As
    in jax's promotion lattice, the result is weakly typed when the inputs of the highest
    kind (complex over float over integer over bool) all are: an int32 array with ``2.0``
    gives a weak float. Complex inputs are refused (TypeError) unless ``complex_ok``; then
    one complex input makes every result complex. See :func:`as_inexact`.
    """
    arrays = []
    for arg, x in zip(args, xs):
        if isinstance(x, (list, tuple)):
            raise TypeError(
                f"{fn}: {arg} must be an array or a Python scalar, got a {type(x).__name__}; "
                f"pass jnp.asarray({arg}) (as in jax.nn, sequences are not converted "
                f"implicitly)"
            )
        try:
            x = x if isinstance(x, jax.Array) else jnp.asarray(x)
        except TypeError as e:
            raise TypeError(
                f"{fn}: {arg} must be a floating-point array, got {type(x).__name__}"
            ) from e
        if not (
            jnp.issubdtype(x.dtype, jnp.floating)
            or jnp.issubdtype(x.dtype, jnp.integer)
            or x.dtype == jnp.bool_
            or (complex_ok and jnp.issubdtype(x.dtype, jnp.complexfloating))
        ):
            kinds = (
                "complex, floating, integer or boolean"
                if complex_ok
                else "real (floating, integer or boolean)"
            )
            raise TypeError(f"{fn}: {arg} must be a {kinds} array, got {_describe(x)}")
        arrays.append(x)
    dtype = inexact_dtype(jnp.result_type(*arrays))
    top = max(_kind(x) for x in arrays)
    weak = all(x.weak_type for x in arrays if _kind(x) == top)
    return [_to_inexact(x, dtype, weak) for x in arrays]


def _kind(x: jax.Array) -> int:
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return 3
    return 2 if jnp.issubdtype(x.dtype, jnp.floating) else int(x.dtype != jnp.bool_)


def _to_inexact(x: jax.Array, dtype: np.dtype, weak: bool) -> jax.Array:
    if x.dtype == dtype and x.weak_type == weak:
        return x
    if weak and not jnp.issubdtype(x.dtype, jnp.inexact):
        # Adding a weak 0.0 gives a weak float of the default width, as jnp keeps
        # jnp.exp(2) weakly typed (a weak result's dtype is always that width).
        y = x + 0.0
        return y if y.dtype == dtype else y.astype(dtype)
    return x.astype(dtype)


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
