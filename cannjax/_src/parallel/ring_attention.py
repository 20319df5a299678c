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
uses the global output). In a second ring pass the keys and values stay and sum their
``dk, dv`` in place, while the query side (``q, dO, lse, D``) travels with its ``dq``
accumulator, which arrives home after ``R`` steps: the stationary accumulators become
the gradients without a copy, and only one accumulator travels. The tangent is the sum
of the blocks' tangents as in the forward, so forward mode and second order work too.

The forward and backward read blocks straight from the operands' ``[B, L, heads, H]``
layout (:class:`_Natural`), so no whole array is copied into the kernels' grouped layout;
the loops' carries start as exchanges' results, not copies of the inputs; and the
backward's accumulators and first exchange are made from a value of the backward
(:func:`cannjax._src.ops.attention.zeros_after`), so that XLA:CPU's scheduler cannot
start them during the forward. What one device holds is then its own operands, the
block passing through and the accumulators: 0.14x blockwise attention's gradient temp
over the whole sequence on 8 devices (benchmarks/sharding.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cannjax._src.core import half_bits
from cannjax._src.core.operator import defop
from cannjax._src.core.vma import varying_like
from cannjax._src.ops import attention as _attn

_FN = "cannjax.parallel.ring_attention"
_STATIC = ("axis_name", "causal", "scale", "bq", "bk")


class _Natural(_attn._Ctx):
    """The blockwise kernels' geometry over the operands' own layouts: q-side arrays
    ``[B, Tp, N, H]``, kv-side ``[B, Sp, K, H]``, per-row statistics ``[B, N, Tp]`` (the
    saved lse's). Each block is moved into the kernels' ``[B, K, rows, H]`` as it is
    read, so no whole array is ever copied into another layout: a copy of a loop's
    operand in XLA:CPU is a buffer that lives as long as the loop."""

    def qrows(self, x, i):
        B, K, G, bq = self.B, self.K, self.G, self.bq
        if x.ndim == 3:  # [B, N, Tp] -> [B, K, G * bq]
            return lax.dynamic_slice_in_dim(x, i * bq, bq, axis=2).reshape(B, K, G * bq)
        blk = lax.dynamic_slice_in_dim(x, i * bq, bq, axis=1).reshape(B, bq, K, G, -1)
        return self.from_bits(jnp.transpose(blk, (0, 2, 3, 1, 4)).reshape(B, K, G * bq, -1))

    def put_qrows(self, x, i, blk):
        B, N, bq = self.B, self.N, self.bq
        if x.ndim == 3:
            blk = blk.reshape(B, N, bq)
            return lax.dynamic_update_slice_in_dim(x, blk.astype(x.dtype), i * bq, axis=2)
        blk = jnp.transpose(blk.reshape(B, self.K, self.G, bq, -1), (0, 3, 1, 2, 4))
        blk = blk.reshape(B, bq, N, -1).astype(x.dtype)
        return lax.dynamic_update_slice_in_dim(x, blk, i * bq, axis=1)

    def kcols(self, x, j):
        blk = lax.dynamic_slice_in_dim(x, j * self.bk, self.bk, axis=1)
        return self.from_bits(jnp.transpose(blk, (0, 2, 1, 3)))

    def put_kcols(self, x, j, blk):
        blk = jnp.transpose(blk, (0, 2, 1, 3)).astype(x.dtype)
        return lax.dynamic_update_slice_in_dim(x, blk, j * self.bk, axis=1)


def _contexts(q, k, causal, scale, bq, bk, ctx=_attn._Ctx):
    """``(own, other)``: the blockwise kernels' geometry for the device's own block
    (causal when ``causal``) and for another device's block (attended whole)."""
    static = dict(scale=scale, bq=bq, bk=bk, has_mask=False, has_bias=False, has_seg=False,
                  cap=None, window=None)  # fmt: skip
    other = ctx(q, k, {}, causal=False, **static)
    return (ctx(q, k, {}, causal=True, **static) if causal else other), other


def _ring(axis_name):
    """``(R, i, rotate)``: the ring size, this device's place and the step to the next."""
    R = lax.axis_size(axis_name)
    perm = [(j, (j + 1) % R) for j in range(R)]
    return R, lax.axis_index(axis_name), lambda x: lax.ppermute(x, axis_name, perm)


def _live(causal, kv, q):
    """Whether the queries of device ``q`` attend the keys of another device ``kv``:
    always (None), or under ``causal`` only when the keys come earlier in the sequence."""
    return kv < q if causal else None


def _padded(c, q, k, v):
    """``q`` zero-padded to ``c.Tp`` positions, ``k, v`` to ``c.Sp`` (no-ops when the
    blocks divide the length; the kernels mask padded keys), as the loops read them
    (:mod:`cannjax._src.core.half_bits`)."""
    pad = _attn._pad_axis
    return tuple(half_bits.as_bits(x) for x in (pad(q, 1, c.Tp), pad(k, 1, c.Sp), pad(v, 1, c.Sp)))


def _kv_groups(c, *xs):
    return tuple(half_bits.as_bits(c.kv(x)) for x in xs)


def _forward(q, k, v, *, axis_name, causal, scale, bq, bk):
    # One online softmax over the whole ring: its state (m, l, acc) stays on the device
    # while the key/value blocks pass through it.
    R, i, rotate = _ring(axis_name)
    own, other = _contexts(q, k, causal, scale, bq, bk, _Natural)
    B, T, N, Tp = own.B, own.T, own.N, own.Tp
    qp, kp, vp = _padded(own, q, k, v)
    state = (jnp.full((B, N, Tp), -jnp.inf, own.acc), jnp.zeros((B, N, Tp), own.acc),
             jnp.zeros(qp.shape, own.acc))  # fmt: skip
    if own.rounded:  # the sum of the rounded probabilities (attention._softmax_pairs)
        state += (jnp.zeros((B, N, Tp), own.acc),)
    state = varying_like(state, q, axes=(axis_name,))
    state = _attn._softmax_pairs(own, qp, kp, vp, state)

    def step(carry, s):
        state, kg, vg = carry
        state = _attn._softmax_pairs(other, qp, kg, vg, state, _live(causal, (i - s) % R, i))
        return (state, rotate(kg), rotate(vg)), None

    if R > 1:
        # The loop's carry starts as the first exchange's result (a fresh buffer, not a
        # copy of the inputs), and the last block is taken in after it.
        carry = (state, rotate(kp), rotate(vp))
        (state, kg, vg), _ = lax.scan(step, carry, jnp.arange(1, R - 1))
        state = _attn._softmax_pairs(other, qp, kg, vg, state, _live(causal, (i - R + 1) % R, i))
    m, den, acc = state[:3]
    seen = den > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, den, 1.0)), 0.0)[:, :, :T]
    if own.rounded:  # acc's weights are the rounded probabilities
        den = state[3]
        seen = den > 0
    den = jnp.transpose(jnp.where(seen, den, 1.0), (0, 2, 1))[..., None]
    exact = jnp.where(jnp.transpose(seen, (0, 2, 1))[..., None], acc / den, 0.0)[:, :T]
    out = exact.astype(q.dtype)
    # What the backward keeps for D (attention._softmax_finish): O itself, or in half
    # precision round(O - mean of the device's values).
    kept = out
    if own.rounded:
        kept = (exact - _by_query_head(own, _attn._values_mean(v, own.acc))).astype(q.dtype)
    return out, {"q": q, "k": k, "v": v, "out": kept, "lse": lse}


def _by_query_head(c, x):
    """A ``[B, K, H]`` per-key-head array as ``[B, 1, N, H]`` (query head ``n`` reads
    key head ``n // G``), to broadcast over ``[B, T, N, H]``."""
    return jnp.repeat(x, c.G, axis=1)[:, None]


def _backward(res, g, *, axis_name, causal, scale, bq, bk):
    # The key/value block and its dk, dv accumulators stay; the query side (q, dO, lse,
    # D) travels with its dq accumulator, which arrives home after R exchanges.
    R, i, rotate = _ring(axis_name)
    q, k, v = res["q"], res["k"], res["v"]
    own, other = _contexts(q, k, causal, scale, bq, bk, _Natural)
    T, Tp, acc_t = own.T, own.Tp, own.acc
    qp, kp, vp = _padded(own, q, k, v)
    dog = half_bits.as_bits(_attn._pad_axis(g, 1, Tp))
    # Padded rows: lse = inf (probability 0), D = 0.
    lse = jnp.pad(res["lse"], [(0, 0), (0, 0), (0, Tp - T)], constant_values=jnp.inf)
    out = res["out"].astype(acc_t)
    if own.rounded:  # kept = round(O - mean_j v) (_forward)
        out = out + _by_query_head(own, _attn._values_mean(v, acc_t))
    d = jnp.sum(g.astype(acc_t) * out, -1)
    d = _attn._pad_axis(jnp.transpose(d, (0, 2, 1)), 2, Tp)
    # Accumulators and the first exchange of the query side made from a value of the
    # backward (module doc): zeros [B, N, Tp], as [B, Tp, N, 1] and [B, 1, 1, 1].
    zrows = _attn.zeros_after(d)
    zq = jnp.transpose(zrows, (0, 2, 1))[..., None]
    zk = zrows.max((1, 2))[:, None, None, None]
    acc = [jnp.broadcast_to(z, x.shape) for z, x in ((zq, qp), (zk, kp), (zk, vp))]
    acc = varying_like(acc, res, g, axes=(axis_name,))
    dq, dk, dv = _attn._grad_pairs(own, qp, kp, vp, lse, dog, d, acc)

    def pairs(rows, dq, dk, dv, s):
        # The rows of device src = i - s against this device's keys.
        qg, dog, lse, d = rows
        live = _live(causal, i, (i - s) % R)
        return _attn._grad_pairs(other, qg, kp, vp, lse, dog, d, (dq, dk, dv), live)

    def step(carry, s):
        rows, dq, dk, dv = carry
        dq, dk, dv = pairs(rows, dq, dk, dv, s)
        return (tuple(map(rotate, rows)), rotate(dq), dk, dv), None

    if R > 1:
        # q and dO travel as their uint16 bits (_padded): adding the zeros, cast to
        # uint16, leaves the bits as they are.
        zeros = (zq, zq, zrows, zrows)
        rows = tuple(rotate(x + z.astype(x.dtype)) for x, z in zip((qp, dog, lse, d), zeros))
        dq = rotate(dq)
        (rows, dq, dk, dv), _ = lax.scan(step, (rows, dq, dk, dv), jnp.arange(1, R - 1))
        dq, dk, dv = pairs(rows, dq, dk, dv, R - 1)
        dq = rotate(dq)
    return (dq[:, :T].astype(q.dtype), dk[:, :T].astype(k.dtype), dv[:, :T].astype(v.dtype))


def _tangent(res, tq, tk, tv, *, axis_name, causal, scale, bq, bk):
    # The tangent's sums over the keys (module doc) gather as the forward's state does.
    R, i, rotate = _ring(axis_name)
    q, k, v = res["q"], res["k"], res["v"]
    own, other = _contexts(q, k, causal, scale, bq, bk)
    qg, lse = _attn._prepare_q(own, q, res["lse"])
    qg, tqg = half_bits.as_bits(qg), half_bits.as_bits(_attn._group_q(tq, own.K, own.G, own.Tp))
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
    v_mean = _attn._values_mean(v, own.acc) if own.rounded else None
    return _attn._tangent_finish(own, state, res["out"], tq.dtype, v_mean)


_ring_attention = defop(
    "ring_attention",
    forward=jax.jit(_forward, static_argnames=_STATIC),
    tangent=jax.jit(_tangent, static_argnames=_STATIC),
    backward=jax.jit(_backward, static_argnames=_STATIC),
    residuals={
        "q": "the local queries [B, T/R, N, H] (an input)",
        "k": "the local keys [B, T/R, K, H] (an input)",
        "v": "the local values [B, T/R, K, H] (an input)",
        "out": "the local output [B, T/R, N, H]; half precision: round(output - the "
        "local values' mean over the keys)",
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
