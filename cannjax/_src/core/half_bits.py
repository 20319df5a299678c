"""Half-precision arrays carried through loops as their ``uint16`` bits.

XLA:CPU's float normalization runs a bfloat16 (or float16) ``transpose``,
``dynamic-slice`` or ``dynamic-update-slice`` in float32, and the conversions it adds
move out of a loop's body: a loop that reads blocks of a half-precision operand (a
``lax.scan`` over chunks of rows, attention's block pairs) holds a float32 copy of the
whole operand, and one that stacks half-precision outputs converts the whole stack to
float32 and back at every step. The same data as ``uint16`` bits is left as it is, and
each block is bitcast back where it is used: no conversion, and no float32 copy.

It is not always a gain. Attention reads its operands' blocks straight into products
and gains; the chunked cross-entropy also transposes each chunk of ``x`` for the weight
gradient, and XLA:CPU transposes 16-bit integers slower than it does float32 (which is
how it runs a bfloat16 transpose), so its loops keep bfloat16 chunks.

Example:
  >>> import jax.numpy as jnp
  >>> from cannjax._src.core.half_bits import as_bits, from_bits
  >>> x = jnp.array([1.5, -2.0], jnp.bfloat16)
  >>> as_bits(x).dtype
  dtype('uint16')
  >>> from_bits(as_bits(x), x.dtype).tolist()
  [1.5, -2.0]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike


def is_half(dtype: DTypeLike) -> bool:
    """Whether ``dtype`` is a 16-bit floating dtype (bfloat16, float16)."""
    dtype = jnp.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2


def as_bits(x: jax.Array) -> jax.Array:
    """A half-precision ``x`` as its ``uint16`` bits; any other ``x`` as it is."""
    return lax.bitcast_convert_type(x, jnp.uint16) if is_half(x.dtype) else x


def from_bits(x: jax.Array, dtype: DTypeLike) -> jax.Array:
    """The inverse of :func:`as_bits` for an array that was of ``dtype``."""
    return lax.bitcast_convert_type(x, dtype) if x.dtype == jnp.uint16 and is_half(dtype) else x
