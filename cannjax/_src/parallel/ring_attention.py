"""Ring attention: attention over a sequence sharded across the devices of a mesh axis.

Device ``i`` of ``R`` holds the queries, keys and values of positions ``[i L, (i + 1) L)``
(``L = T / R``). The key/value blocks travel around the ring (``lax.ppermute`` to
device ``i + 1``), and at step ``s`` device ``i`` attends its queries to the block of
device ``src = i - s (mod R)``. The online softmax of :mod:`cannjax.ops.attention` (its
running row maximum ``m``, normalizer ``l`` and unnormalized output) stays on the device
and takes in each block's key tiles as they arrive, exactly as it takes in the tiles of
one device's keys: the result is that kernel's over the whole sequence.

Causal: the block of ``src < i`` is attended whole, the own block causally, and blocks of
``src > i`` are skipped. No device ever holds more than two key/value blocks, so the
memory per device is that of attention over ``L`` positions.

Backward (hand-written, Liu et al. 2023): with the merged ``out`` and ``lse`` saved, each
block's ``dq, dk, dv`` is FlashAttention-2's for that block alone
(``p = e^(s - lse)`` is already normalized by the global lse, and ``D = rowsum(dO * O)``
uses the global output), so a second ring pass sums ``dq`` in place while the ``dk, dv``
accumulators travel with their key/value block and arrive home after ``R`` steps. The
tangent is the sum of the blocks' tangents in the same way, so forward mode and second
order work too. Every accumulator is kept in the kernels' grouped layout from the first
step to the last (one layout change in, one out).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cannjax._src.core.operator import defop
from cannjax._src.core.vma import varying_like
from cannjax._src.ops import attention as _attn

_FN = "cannjax.parallel.ring_attention"
_STATIC = ("axis_name", "causal", "scale", "bq", "bk")


def _contexts(q, k, causal, scale, bq, bk):
    """``(own, other)``: the blockwise kernels' geometry for the device's own block
    (causal when ``causal``) and for another device's block (attended whole)."""
    static = dict(scale=scale, bq=bq, bk=bk, has_mask=False, has_bias=False, has_seg=False,
                  cap=None, window=None)  # fmt: skip
    other = _attn._Ctx(q, k, {}, causal=False, **static)
    return (_attn._Ctx(q, k, {}, causal=True, **static) if causal else other), other


def _ring(axis_name):
    """``(R, i, rotate)``: the ring size, this device's place and the step to the next."""
    R = lax.axis_size(axis_name)
    perm = [(j, (j + 1) % R) for j in range(R)]
    return R, lax.axis_index(axis_name), lambda x: lax.ppermute(x, axis_name, perm)


def _live(causal, src, i):
    """Whether the block of device ``src`` is attended by device ``i`` (another's block):
    always (None), or under ``causal`` only when it comes earlier in the sequence."""
    return src < i if causal else None


def _kv_groups(c, *xs):
    return tuple(c.kv(x) for x in xs)


def _forward(q, k, v, *, axis_name, causal, scale, bq, bk):
    # One online softmax over the whole ring: its state (m, l, acc) stays on the device
    # while the key/value blocks pass through it.
    R, i, rotate = _ring(axis_name)
    own, other = _contexts(q, k, causal, scale, bq, bk)
    qg = _attn._group_q(q, own.K, own.G, own.Tp)
    kg, vg = _kv_groups(own, k, v)
    state, kg, vg = varying_like((_attn._softmax_init(own), kg, vg), q, axes=(axis_name,))
    state = _attn._softmax_pairs(own, qg, kg, vg, state)

    def step(carry, s):
        state, kg, vg = carry
        kg, vg = rotate(kg), rotate(vg)
        live = _live(causal, (i - s) % R, i)
        return (_attn._softmax_pairs(other, qg, kg, vg, state, live), kg, vg), None

    (state, _, _), _ = lax.scan(step, (state, kg, vg), jnp.arange(1, R))
    out, lse = _attn._softmax_finish(own, state, q.dtype)
    return out, {"q": q, "k": k, "v": v, "out": out, "lse": lse}


def _backward(res, g, *, axis_name, causal, scale, bq, bk):
    # The dq accumulator stays; the dk, dv accumulators travel with their key/value block
    # and are rotated home at the end.
    R, i, rotate = _ring(axis_name)
    q, k, v = res["q"], res["k"], res["v"]
    own, other = _contexts(q, k, causal, scale, bq, bk)
    qg, lse = _attn._prepare_q(own, q, res["lse"])
    dog, d = _attn._grad_rows(own, g, res["out"])
    kg, vg = _kv_groups(own, k, v)
    acc = [jnp.zeros(x.shape, own.acc) for x in (qg, kg, vg)]
    acc, kg, vg = varying_like((acc, kg, vg), res, g, axes=(axis_name,))
    dq, dk, dv = _attn._grad_pairs(own, qg, kg, vg, lse, dog, d, acc)

    # The key/value blocks move at the start of a step and their accumulators at its end
    # (after the block's products), so that no more than two blocks are in flight at once.
    def step(carry, s):
        dq, dk, dv, kg, vg = carry
        kg, vg = rotate(kg), rotate(vg)
        live = _live(causal, (i - s) % R, i)
        dq, dk, dv = _attn._grad_pairs(other, qg, kg, vg, lse, dog, d, (dq, dk, dv), live)
        return (dq, rotate(dk), rotate(dv), kg, vg), None

    dk, dv = rotate(dk), rotate(dv)
    (dq, dk, dv, _, _), _ = lax.scan(step, (dq, dk, dv, kg, vg), jnp.arange(1, R))
    dq = _attn._ungroup_q(dq, own.T).astype(q.dtype)
    return dq, own.kv_out(dk, k.dtype), own.kv_out(dv, v.dtype)


def _tangent(res, tq, tk, tv, *, axis_name, causal, scale, bq, bk):
    # The tangent's sums over the keys (module doc) gather as the forward's state does.
    R, i, rotate = _ring(axis_name)
    q, k, v = res["q"], res["k"], res["v"]
    own, other = _contexts(q, k, causal, scale, bq, bk)
    qg, lse = _attn._prepare_q(own, q, res["lse"])
    tqg = _attn._group_q(tq, own.K, own.G, own.Tp)
    blocks = _kv_groups(own, k, v, tk, tv)
    state, blocks = varying_like(
        (_attn._tangent_init(own), blocks), res, tq, tk, tv, axes=(axis_name,)
    )
    state = _attn._tangent_pairs(own, qg, *blocks[:2], lse, tqg, *blocks[2:], None, state)

    def step(carry, s):
        state, blocks = carry
        kg, vg, tkg, tvg = (rotate(x) for x in blocks)
        live = _live(causal, (i - s) % R, i)
        state = _attn._tangent_pairs(other, qg, kg, vg, lse, tqg, tkg, tvg, None, state, live)
        return (state, (kg, vg, tkg, tvg)), None

    (state, _), _ = lax.scan(step, (state, blocks), jnp.arange(1, R))
    return _attn._tangent_finish(own, state, res["out"], tq.dtype)


_ring_attention = defop(
    "ring_attention",
    forward=jax.jit(_forward, static_argnames=_STATIC),
    tangent=jax.jit(_tangent, static_argnames=_STATIC),
    backward=jax.jit(_backward, static_argnames=_STATIC),
    residuals={
        "q": "the local queries [B, T/R, N, H] (an input)",
        "k": "the local keys [B, T/R, K, H] (an input)",
        "v": "the local values [B, T/R, K, H] (an input)",
        "out": "the local output [B, T/R, N, H]",
        "lse": "per-row logsumexp over all keys [B, N, T/R], in the compute dtype",
    },
)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    axis_name: str,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> jax.Array:
    """Attention over a sequence sharded on mesh axis ``axis_name``, inside ``shard_map``.

    Each of the ``R`` devices of the axis passes its own part of the sequence (device
    ``i`` holds positions ``[i L, (i + 1) L)``) and gets the attention of its queries to
    the keys of all devices: :func:`cannjax.ops.attention` over the whole sequence,
    computed with ``R - 1`` key/value exchanges (``lax.ppermute``) and a hand-written
    backward that makes another ring pass (module doc). Memory per device is that of
    attention over ``L`` positions.

    Args:
      q: local queries ``[B, L, N, H]``, floating point.
      k: local keys ``[B, L, K, H]`` (``K`` divides ``N``: grouped-query heads).
      v: local values ``[B, L, K, H]``.
      axis_name: the mesh axis the sequence is sharded over (bound by ``shard_map``).
      causal: query ``t`` attends only keys ``j <= t`` (global positions).
      scale: multiplies the logits; ``1 / sqrt(H)`` when None.
      block_q: query rows per block of the local kernel (default as
        :func:`cannjax.ops.attention`).
      block_k: key columns per block, likewise.

    Returns:
      the local output ``[B, L, N, H]`` of ``q``'s dtype.

    Raises:
      TypeError: non-floating or mismatched dtypes, a non-bool ``causal``.
      ValueError: shapes that are not ``[B, L, N, H]`` / ``[B, L, K, H]`` with equal
        ``B``, ``L`` and ``H`` and ``K`` dividing ``N``, or ``axis_name`` not bound by an
        enclosing ``shard_map``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, cannjax
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:4]), ("seq",))
      >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 32, 2, 8))
      >>> ring = jax.shard_map(
      ...     lambda q, k, v: cannjax.parallel.ring_attention(q, k, v, "seq", causal=True),
      ...     mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
      >>> whole = cannjax.ops.attention(q, k, v, causal=True)
      >>> bool(jnp.allclose(ring(q, k, v), whole, atol=1e-5))
      True

    References:
      Liu, Zaharia and Abbeel, "Ring Attention with Blockwise Transformers for
      Near-Infinite Context", 2023. https://arxiv.org/abs/2310.01889
    """
    q, k, v = (_as_float(n, a) for n, a in (("q", q), ("k", k), ("v", v)))
    _check(q, k, v)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{_FN}: causal must be a bool, got {causal!r}")
    if not isinstance(axis_name, str):
        raise TypeError(f"{_FN}: axis_name must be a str (a mesh axis), got {axis_name!r}")
    try:
        lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"{_FN}: axis_name {axis_name!r} is not bound; call ring_attention inside "
            f"jax.shard_map over a mesh with an axis {axis_name!r}, the sequence sharded on it"
        ) from None
    H = q.shape[3]
    if scale is None:
        scale = 1.0 / math.sqrt(H)
    elif isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.floating)):
        raise TypeError(f"{_FN}: scale must be a Python float (static), got {scale!r}")
    dq, dk = _attn.attention_block_sizes()
    L = q.shape[1]
    bq = _block(block_q, dq, L, "block_q")
    bk = _block(block_k, dk, L, "block_k")
    return _ring_attention(
        q, k, v, axis_name=axis_name, causal=bool(causal), scale=float(scale), bq=bq, bk=bk
    )


def _as_float(name, a):
    a = jnp.asarray(a)
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(
            f"{_FN}: {name} must be a floating-point array, got {a.dtype}{list(a.shape)}"
        )
    return a


def _check(q, k, v):
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 4:
            raise ValueError(f"{_FN}: {name} must have rank 4 ([B, L, heads, H]), got {a.shape}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            f"{_FN}: q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    (B, L, N, H), (Bk, S, K, Hk) = q.shape, k.shape
    if k.shape != v.shape or (B, L, H) != (Bk, S, Hk) or K == 0 or N % K:
        raise ValueError(
            f"{_FN}: expected q [B, L, N, H] and k, v [B, L, K, H] with K dividing N (the "
            f"local blocks of one sequence), got q {q.shape}, k {k.shape}, v {v.shape}"
        )


def _block(value, default, length, name):
    if value is None:
        return min(default, length)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{_FN}: {name} must be an int or None, got {value!r}")
    if value < 1:
        raise ValueError(f"{_FN}: {name} must be >= 1, got {value}")
    return min(int(value), length)
