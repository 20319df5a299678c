"""The platform facts: cannjax's one answer to everything it does differently per platform.

Two things decide every per-platform choice:

* **the platform asked about**: the ``platform`` argument, or ``jax.default_backend()``
  when it is None (``"gpu"`` is read as ``"cuda"``; names are compared in lower case);
* **the Ascend platform name** (:func:`ascend_platform`): the name set by
  ``cannjax.backend.ascend.configure(platform=...)``, else ``$CANNJAX_ASCEND_PLATFORM``
  (read when asked, as the PJRT plugin reads it when JAX starts), else ``"ascend"``.
  No other name is Ascend: ``"npu"`` is Ascend only when configured so.

:func:`facts` derives the rest, and every consumer reads it: ``cannjax.amp.half_dtype``
and ``cannjax.amp.default_overflow_check``, ``cannjax.backend.info()``, the matmul
padding, ``cannjax.amp.skip_nonfinite`` and ``cannjax.parallel.data_parallel``.

Ascend's Cube unit multiplies 16x16 float16 tiles, and Ascend NPUs run by default in
*saturation mode*: a float16 overflow clamps to the largest finite value (65504) instead
of becoming ``inf``, so ``isfinite`` alone does not see it. Other platforms use bfloat16
for mixed precision and IEEE ``inf``/``nan`` semantics.

Example:
  >>> from cannjax.backend import facts
  >>> f = facts("ascend")
  >>> f.is_ascend, f.half_dtype.name, f.overflow_mode, f.matmul_multiple
  (True, 'float16', 'saturation', 16)
  >>> facts("cpu").half_dtype.name, facts("cpu").overflow_mode
  ('bfloat16', 'isfinite')
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import cannjax_ascend_plugin

OVERFLOW_MODES = ("isfinite", "saturation")

_GPU_PLATFORMS = ("cuda", "rocm")

# Set by cannjax.backend.ascend.configure(platform=...); None: follow the environment.
_ascend_override: str | None = None


def ascend_platform() -> str:
    """The platform name cannjax treats as Ascend.

    The name given to ``cannjax.backend.ascend.configure(platform=...)`` if any, else
    ``$CANNJAX_ASCEND_PLATFORM`` (read now, through ``cannjax_ascend_plugin``, the
    variable's one reader), else ``"ascend"``.

    Raises:
      ValueError: if ``$CANNJAX_ASCEND_PLATFORM`` is not a lower-case identifier.
    """
    if _ascend_override is not None:
        return _ascend_override
    return cannjax_ascend_plugin.platform_name()


def set_ascend_platform(name: str | None) -> None:
    """Sets the Ascend platform name (None: follow ``$CANNJAX_ASCEND_PLATFORM`` again).

    The setter behind ``cannjax.backend.ascend.configure(platform=...)``, which validates
    the name and moves the Ascend kernel entries with it; call that instead.
    """
    global _ascend_override
    if name is not None and not isinstance(name, str):
        raise TypeError(f"set_ascend_platform: name must be a str or None, got {name!r}")
    _ascend_override = name


@dataclasses.dataclass(frozen=True)
class PlatformFacts:
    """What cannjax does on one platform.

    Attributes:
      name: the platform name (lower case; ``"gpu"`` read as ``"cuda"``).
      is_ascend: whether ``name`` is the Ascend platform name (:func:`ascend_platform`).
      half_dtype: the half-precision dtype for mixed precision: ``float16`` on Ascend
        (the Cube unit's native input type; its 910A has no bfloat16), ``bfloat16``
        elsewhere (float32's exponent range, so no loss scaling is needed).
      overflow_mode: how a float16 overflow shows: ``"saturation"`` on Ascend (clamped
        to the largest finite value), ``"isfinite"`` elsewhere (``inf``/``nan``).
      matmul_multiple: the multiple matmul dimensions are padded to: 16 on Ascend (the
        Cube unit's tile), 1 (no padding) elsewhere.
      skip_mode: how ``cannjax.amp.skip_nonfinite`` chooses between the applied and the
        skipped update by default: ``"select"`` on GPU (no host round trip for the
        predicate), ``"cond"`` elsewhere (only the taken branch runs).
      half_stacks_convert: whether writing one slice of a stacked half-precision array
        (``lax.scan``'s stacked outputs and saved residuals: a ``dynamic-update-slice``)
        converts the whole stack to float32 and back: True on ``"cpu"``, whose XLA has no
        half-precision ``dynamic-update-slice``, so an ``L``-step scan pays ``O(L^2)``
        element conversions; the models then unroll their layer loop in half precision
        (``GPTConfig.unroll``).
    """

    name: str
    is_ascend: bool
    half_dtype: np.dtype
    overflow_mode: str
    matmul_multiple: int
    skip_mode: str
    half_stacks_convert: bool


def _platform_name(fn: str, platform: str | None) -> str:
    if platform is None:
        platform = jax.default_backend()
    elif not isinstance(platform, str) or not platform.strip():
        raise TypeError(
            f"{fn}: platform must be a platform name such as 'cpu', 'cuda' or 'ascend', "
            f"or None for jax.default_backend(), got {platform!r}"
        )
    name = platform.strip().lower()
    return "cuda" if name == "gpu" else name


def _facts(fn: str, platform: str | None) -> PlatformFacts:
    """:func:`facts`, with errors naming the public function ``fn``."""
    name = _platform_name(fn, platform)
    ascend = name == ascend_platform()
    return PlatformFacts(
        name=name,
        is_ascend=ascend,
        half_dtype=np.dtype(jnp.float16 if ascend else jnp.bfloat16),
        overflow_mode="saturation" if ascend else "isfinite",
        matmul_multiple=16 if ascend else 1,
        skip_mode="select" if name in _GPU_PLATFORMS and not ascend else "cond",
        half_stacks_convert=name == "cpu",
    )


def facts(platform: str | None = None) -> PlatformFacts:
    """The :class:`PlatformFacts` of ``platform``.

    Args:
      platform: a platform name; None means ``jax.default_backend()``.

    Returns:
      The facts, computed from the Ascend platform name in force now: read the one that
      matters (``facts().half_dtype``, ``facts("ascend").overflow_mode``, ...).

    Raises:
      TypeError: if ``platform`` is neither a non-empty string nor None.
    """
    return _facts("cannjax.backend.facts", platform)
