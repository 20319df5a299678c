"""The models' compute dtype: ``dtype=`` of a config, as flax's ``dtype`` is.

Parameters are stored in their own dtype (float32 master weights, as ``init_gpt`` and
``init_llama`` make them by default) and cast to the compute dtype where the model reads
them, inside the loss: the gradient flows back through the cast, so it arrives in the
parameters' dtype, and the optimizer updates float32 weights. The loss is returned in
float32 whatever the compute dtype.

The layer loop (``lax.scan`` over stacked weights) is unrolled in half precision where
the platform writes stacked half arrays through float32
(``PlatformFacts.half_stacks_convert``, XLA:CPU): there each layer's saved residuals
would cost a float32 round trip of the whole stack (:func:`layer_unroll`).

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
import numpy as np

from cannjax._src.core.platform import facts

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


def check_unroll(config: str, unroll: Any) -> int | None:
    """``unroll`` of a config: None or a positive int, else a ``ValueError`` naming
    ``config``."""
    if unroll is None:
        return None
    if isinstance(unroll, (bool, np.bool_)) or not isinstance(unroll, (int, np.integer)):
        raise ValueError(
            f"{config}: unroll must be None (chosen per platform) or a positive int, got {unroll!r}"
        )
    if unroll < 1:
        raise ValueError(f"{config}: unroll must be a positive int, got {unroll!r}")
    return int(unroll)


def layer_unroll(unroll: int | None, layers: int, dtype: Any) -> int:
    """How many layers one iteration of the layer scan runs (``lax.scan``'s ``unroll``).

    ``unroll`` when the config sets it; otherwise every layer (the scan unrolled) when
    ``dtype`` is a half dtype and the default backend writes stacked half arrays through
    float32 (``PlatformFacts.half_stacks_convert``): XLA:CPU writes one layer's slice of
    a stacked ``bf16[L, ...]`` residual by converting the whole stack to float32 and
    back, ``O(L^2)`` conversions per step, where an unrolled loop keeps each layer's
    residuals apart. 1 (a rolled loop: one compiled layer) otherwise.
    """
    if unroll is not None:
        return unroll
    half = jnp.dtype(dtype).itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)
    return layers if half and facts().half_stacks_convert else 1


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
