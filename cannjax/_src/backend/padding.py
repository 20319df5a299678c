"""Matmul operand padding to the platform's tile multiple, when it pays.

Ascend's Cube unit computes on 16x16 tiles; a matmul whose M, K or N is not a multiple
of 16 goes through a slower, format-converting path. Zero-padding the operands to
multiples of 16 and slicing the result is exact (the padded rows and columns of K add
zeros) and pays when the padding adds little work. The policy, :func:`matmul_padding`:
pad only on platforms whose ``cannjax.backend.facts(platform).matmul_multiple`` exceeds 1, only
dimensions of at least that multiple (tiny dimensions would multiply the work), and only
if the padded product ``Mp * Kp * Np`` exceeds ``M * K * N`` by at most ``max_overhead``
(default 25%). The thresholds are a documented heuristic, not measured on hardware.

Example:
  >>> from cannjax.backend import matmul_padding
  >>> matmul_padding(100, 200, 300, platform="ascend")
  (112, 208, 304)
  >>> matmul_padding(100, 200, 300, platform="cpu")
  (100, 200, 300)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from cannjax._src.core.platform import _facts


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def matmul_padding(
    m: int,
    k: int,
    n: int,
    *,
    platform: str | None = None,
    multiple: int | None = None,
    max_overhead: float = 0.25,
) -> tuple[int, int, int]:
    """The padded ``(M, K, N)`` of an ``(M, K) @ (K, N)`` product on ``platform``.

    Returns the input sizes unchanged when padding does not pay (see the module doc).

    Args:
      m, k, n: the product's dimensions.
      platform: platform name (None: the default backend); gives the multiple.
      multiple: overrides the platform's multiple.
      max_overhead: largest accepted relative increase of ``M * K * N``.

    Raises:
      ValueError: negative sizes, a multiple < 1 or a negative ``max_overhead``.
      TypeError: a ``platform`` that is neither a platform name nor None.
    """
    fn = "cannjax.backend.matmul_padding"
    for name, v in (("m", m), ("k", k), ("n", n)):
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{fn}: {name} must be a non-negative int, got {v!r}")
    mult = _facts(fn, platform).matmul_multiple if multiple is None else multiple
    if not isinstance(mult, int) or mult < 1:
        raise ValueError(f"{fn}: multiple must be an int >= 1, got {mult!r}")
    if max_overhead < 0:
        raise ValueError(f"{fn}: max_overhead must be >= 0, got {max_overhead!r}")
    dims = (m, k, n)
    padded = tuple(_round_up(d, mult) if d >= mult else d for d in dims)
    if mult == 1 or padded == dims:
        return dims
    if padded[0] * padded[1] * padded[2] > (1 + max_overhead) * m * k * n:
        return dims
    return padded


def pad_for_platform(
    matmul: Callable[[jax.Array, jax.Array], jax.Array],
    *,
    platform: str | None = None,
    multiple: int | None = None,
    max_overhead: float = 0.25,
) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """Wraps ``matmul(a, b)`` (``a[..., M, K] @ b[K, N] -> [..., M, N]``) with padding.

    The operands are zero-padded to :func:`matmul_padding`'s sizes, ``matmul`` runs on
    the padded operands and the result is sliced back: the values are exactly those of
    ``matmul(a, b)``. Use it in the kernel table entry of a matmul-like op for a platform
    with a tile multiple (``register_kernel(op, "ascend", forward=...)``).

    Example:
      >>> import jax.numpy as jnp
      >>> from cannjax.backend import pad_for_platform
      >>> mm = pad_for_platform(jnp.matmul, platform="ascend")
      >>> mm(jnp.ones((30, 40)), jnp.ones((40, 50))).shape
      (30, 50)
    """

    @functools.wraps(matmul)
    def padded(a: jax.Array, b: jax.Array) -> jax.Array:
        if a.ndim < 2 or b.ndim != 2 or a.shape[-1] != b.shape[0]:
            raise ValueError(
                "cannjax.backend.pad_for_platform: expected a[..., M, K] and b[K, N], got "
                f"a.shape={a.shape} and b.shape={b.shape}"
            )
        m, k = a.shape[-2:]
        n = b.shape[1]
        mp, kp, np_ = matmul_padding(
            m, k, n, platform=platform, multiple=multiple, max_overhead=max_overhead
        )
        if (mp, kp, np_) == (m, k, n):
            return matmul(a, b)
        a_pad = [(0, 0)] * (a.ndim - 2) + [(0, mp - m), (0, kp - k)]
        out = matmul(jnp.pad(a, a_pad), jnp.pad(b, [(0, kp - k), (0, np_ - n)]))
        return out[..., :m, :n]

    return padded
