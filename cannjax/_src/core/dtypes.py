"""The one rule for computing in at least float32.

Half-precision inputs (float16, bfloat16) are computed in float32: sums over many terms
and derivatives such as ``1 - y^2`` lose too much in 8 or 11 bits of mantissa. Results
are cast back to the input dtype by the caller. float32 and float64 stay as they are.

The rule is stated, not derived with ``jnp.promote_types``: under
``jax.numpy_dtype_promotion("strict")`` float64 (or bfloat16) and float32 have no
promotion path, and the rule must hold there too. For the same reason every constant an
operator mixes with its inputs is a Python scalar (weakly typed) or made in the compute
dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike


def compute_dtype(dtype: DTypeLike) -> jnp.dtype:
    """The dtype to compute in for inputs of ``dtype``: at least float32.

    Floating dtypes narrower than 32 bits give float32; wider floating and complex
    dtypes stay; integer and boolean dtypes give the floating dtype ``jnp`` promotes them
    to (float32, float64 for 64-bit integers under x64).
    """
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return dtype if dtype.itemsize >= 4 else jnp.dtype(jnp.float32)
    wide = jnp.issubdtype(dtype, jnp.integer) and dtype.itemsize == 8
    return jnp.dtype(jax.dtypes.canonicalize_dtype(jnp.float64 if wide else jnp.float32))


def upcast(x: jax.Array) -> jax.Array:
    """``x`` in :func:`compute_dtype` if it is floating point, else ``x`` unchanged."""
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != compute_dtype(x.dtype):
        return x.astype(compute_dtype(x.dtype))
    # Unchanged (not astype): a weakly typed float32 input (a Python scalar) stays weak,
    # so the op's output is weak as jax.nn's is.
    return x


def downcast(x: jax.Array, dtype: DTypeLike) -> jax.Array:
    """``x`` cast to ``dtype``, or ``x`` itself (weak type kept) if it has that dtype."""
    return x if x.dtype == jnp.dtype(dtype) else x.astype(dtype)
