"""The one rule for computing in at least float32.

Half-precision inputs (float16, bfloat16) are computed in float32: sums over many terms
and derivatives such as ``1 - y^2`` lose too much in 8 or 11 bits of mantissa. Results
are cast back to the input dtype by the caller. float32 and float64 stay as they are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike


def compute_dtype(dtype: DTypeLike) -> jnp.dtype:
    """The dtype to compute in for inputs of ``dtype``: at least float32."""
    return jnp.promote_types(dtype, jnp.float32)


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
