"""The models' compute dtype: ``dtype=`` of a config, as flax's ``dtype`` is.

Parameters are stored in their own dtype (float32 master weights, as ``init_gpt`` and
``init_llama`` make them by default) and cast to the compute dtype where the model reads
them, inside the loss: the gradient flows back through the cast, so it arrives in the
parameters' dtype, and the optimizer updates float32 weights. The loss is returned in
float32 whatever the compute dtype.

Example:
  >>> import jax.numpy as jnp
  >>> p = {"w": jnp.ones(2), "ids": jnp.arange(2)}
  >>> {k: v.dtype.name for k, v in in_compute_dtype(p, "bfloat16").items()}
  {'ids': 'int32', 'w': 'bfloat16'}
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp

T = TypeVar("T")

DTYPES = ("float32", "bfloat16", "float16", "float64")


def check_dtype(config: str, dtype: Any) -> str | None:
    """``dtype`` as a dtype name of :data:`DTYPES` (None stays None), or a ``ValueError``
    naming ``config`` (``"cannjax.models.GPTConfig"``)."""
    if dtype is None:
        return None
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ValueError(
            f"{config}: dtype must be None (compute in the parameters' dtype) or one of "
            f"{DTYPES}, got {dtype!r}"
        )
    return name


def in_compute_dtype(params: T, dtype: str | None) -> T:
    """``params`` with every floating leaf cast to ``dtype`` (None: unchanged)."""
    if dtype is None:
        return params

    def cast(v):
        if jnp.issubdtype(jnp.result_type(v), jnp.floating):
            return jnp.asarray(v).astype(dtype)
        return v

    return jax.tree.map(cast, params)


def loss_dtype(loss: jax.Array) -> jax.Array:
    """A loss computed in half precision, returned in float32."""
    return loss.astype(jnp.float32) if loss.dtype.itemsize < 4 else loss
