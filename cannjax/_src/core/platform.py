"""Per-platform numeric defaults: half-precision dtype, overflow detection, matmul tiles.

Ascend's Cube unit multiplies 16x16 float16 tiles, and Ascend NPUs run by default in
*saturation mode*: a float16 overflow clamps to the largest finite value (65504) instead
of becoming ``inf``, so ``isfinite`` alone does not see it. Other platforms use bfloat16
for mixed precision and IEEE ``inf``/``nan`` semantics.

Example:
  >>> import jax.numpy as jnp
  >>> from cannjax import backend
  >>> backend.preferred_half_dtype("ascend"), backend.overflow_mode("ascend")
  (dtype('float16'), 'saturation')
  >>> grads = {"w": jnp.array([1.0, 65504.0], jnp.float16)}  # 65504: float16's largest
  >>> bool(backend.detect_overflow(grads, mode="saturation"))
  True
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cannjax._src.backend import ascend

__all__ = [
    "OVERFLOW_MODES",
    "detect_overflow",
    "is_ascend",
    "matmul_multiple",
    "overflow_mode",
    "preferred_half_dtype",
]

OVERFLOW_MODES = ("isfinite", "saturation")


def _platform(fn: str, platform: str | None) -> str:
    if platform is None:
        return jax.default_backend()
    if not isinstance(platform, str) or not platform:
        raise TypeError(f"cannjax.backend.{fn}: platform must be a platform name, got {platform!r}")
    return "cuda" if platform == "gpu" else platform


def _is_ascend(fn: str, platform: str | None) -> bool:
    return _platform(fn, platform) == ascend.config().platform


def is_ascend(platform: str | None = None) -> bool:
    """Whether ``platform`` (default: JAX's default backend) is the configured Ascend one."""
    return _is_ascend("is_ascend", platform)


def preferred_half_dtype(platform: str | None = None) -> np.dtype:
    """The half-precision dtype for mixed precision on ``platform``.

    ``float16`` on Ascend (the Cube unit's native input type), ``bfloat16`` elsewhere
    (no loss scaling needed, native on TPU and recent GPUs; emulated but harmless on CPU).

    Args:
      platform: a platform name; None means ``jax.default_backend()``.
    """
    return np.dtype(jnp.float16 if _is_ascend("preferred_half_dtype", platform) else jnp.bfloat16)


def overflow_mode(platform: str | None = None) -> str:
    """How overflow shows on ``platform``: ``"saturation"`` on Ascend, else ``"isfinite"``."""
    return "saturation" if _is_ascend("overflow_mode", platform) else "isfinite"


def matmul_multiple(platform: str | None = None) -> int:
    """The dimension multiple matmul operands are padded to on ``platform`` (16 on Ascend,
    1, meaning no padding, elsewhere)."""
    return 16 if _is_ascend("matmul_multiple", platform) else 1


def detect_overflow(tree: Any, *, mode: str = "isfinite") -> jax.Array:
    """True (a bool scalar array) if any floating leaf of ``tree`` overflowed.

    * ``"isfinite"``: some element is ``inf`` or ``nan``.
    * ``"saturation"``: as ``"isfinite"``, or some element's magnitude reached its dtype's
      largest finite value, where a saturating unit clamps an overflow.

    Args:
      tree: a pytree of arrays (gradients, typically); non-float leaves are ignored.
      mode: one of :data:`OVERFLOW_MODES`, e.g. ``overflow_mode(platform)``.

    Raises:
      ValueError: an unknown ``mode``.
    """
    if mode not in OVERFLOW_MODES:
        raise ValueError(
            f"cannjax.backend.detect_overflow: mode must be one of {OVERFLOW_MODES}, got {mode!r}"
        )
    flags = [jnp.zeros((), bool)]
    for leaf in jax.tree_util.tree_leaves(tree):
        leaf = jnp.asarray(leaf)
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            continue
        bad = ~jnp.isfinite(leaf)
        if mode == "saturation":
            bad = bad | (jnp.abs(leaf) >= jnp.finfo(leaf.dtype).max)
        flags.append(jnp.any(bad))
    return jnp.any(jnp.stack(flags))
