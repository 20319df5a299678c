"""Ring attention: attention over a sequence sharded across the devices of a mesh axis.

Device ``i`` of ``R`` holds the queries, keys and values of positions ``[i L, (i + 1) L)``
(``L = T / R``). The key/value blocks travel around the ring (``lax.ppermute`` to
device ``i + 1``), and at step ``s`` device ``i`` attends its queries to the block of
device ``src = i - s (mod R)`` with :mod:`cannjax.ops.attention`'s blockwise kernels,
merging the partial results by their logsumexp::

  lse' = logaddexp(lse, lse_b),   out' = e^(lse - lse') out + e^(lse_b - lse') out_b

Causal: the block of ``src < i`` is attended whole, the own block causally, and blocks of
``src > i`` are skipped. No device ever holds more than two key/value blocks, so the
memory per device is that of attention over ``L`` positions.

Backward (hand-written, Liu et al. 2023): with the merged ``out`` and ``lse`` saved, each
block's ``dq, dk, dv`` is FlashAttention-2's for that block alone
(``p = e^(s - lse)`` is already normalized by the global lse, and ``D = rowsum(dO * O)``
uses the global output), so a second ring pass sums ``dq`` in place while the ``dk, dv``
accumulators travel with their key/value block and arrive home after ``R`` steps. The
tangent is the sum of the blocks' tangents in the same way, so forward mode and second
order work too.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cannjax._src.core.dtypes import compute_dtype
from cannjax._src.core.operator import defop
from cannjax._src.core.vma import varying_like
from cannjax._src.ops import attention as _attn

_FN = "cannjax.parallel.ring_attention"
_STATIC = ("axis_name", "causal", "scale", "bq", "bk")


def _kernel_static(scale, bq, bk):
    return dict(scale=scale, bq=bq, bk=bk, has_mask=False, has_bias=False, has_seg=False,
                cap=None, window=None)  # fmt: skip


def _unmasked():
    return jnp.ones((1, 1, 1, 1), bool), jnp.zeros((1, 1), jnp.int32)


def _ring(axis_name):
    """``(R, i, rotate)``: the ring size, this device's place and the step to the next."""
    R = lax.axis_size(axis_name)
    perm = [(j, (j + 1) % R) for j in range(R)]
    return R, lax.axis_index(axis_name), lambda x: lax.ppermute(x, axis_name, perm)


def _case(causal, src, i):
    """0: attend the whole block, 1: the own block causally, 2: skip (all in the future)."""
    if not causal:
        return jnp.zeros((), jnp.int32)
    return jnp.where(src == i, 1, jnp.where(src < i, 0, 2)).astype(jnp.int32)


def _switch(case, branches, axis_name):
    """``lax.switch`` whose branches all return values varying over the ring's axis (the
    own block's result may not vary, a rotated block's does)."""

    def varying(branch):
        return lambda: varying_like(branch(), axes=(axis_name,))

    return lax.switch(case, [varying(b) for b in branches])


def _forward(q, k, v, *, axis_name, causal, scale, bq, bk):
    R, i, rotate = _ring(axis_name)
    acc = compute_dtype(q.dtype)
    mask, ids = _unmasked()
    static = _kernel_static(scale, bq, bk)
    B, T, N, _ = q.shape

    def block(kc, vc, src):
        def attend(is_causal):
            def run():
                out, res = _attn._forward(q, kc, vc, mask, ids, ids, causal=is_causal, **static)
                return out.astype(acc), res["lse"]

            return run

        def skip():
            empty = jnp.zeros(q.shape, acc), jnp.full((B, N, T), -jnp.inf, acc)
            return empty

        return _switch(_case(causal, src, i), [attend(False), attend(True), skip], axis_name)

    out, lse = block(k, v, i)  # the own block first: every row then has a finite lse

    def step(carry, s):
        out, lse, kc, vc = carry
        kc, vc = rotate(kc), rotate(vc)
        out_b, lse_b = block(kc, vc, (i - s) % R)
        new = jnp.logaddexp(lse, lse_b)
        w_old = jnp.swapaxes(jnp.exp(lse - new), 1, 2)[..., None]  # [B, T, N, 1]
        w_new = jnp.swapaxes(jnp.exp(lse_b - new), 1, 2)[..., None]
        return (out * w_old + out_b * w_new, new, kc, vc), None

    init = varying_like((out, lse, k, v), q, k, v, axes=(axis_name,))
    (out, lse, _, _), _ = lax.scan(step, init, jnp.arange(1, R))
    out = out.astype(q.dtype)
    return out, {"q": q, "k": k, "v": v, "out": out, "lse": lse}


def _block_res(res, kc, vc):
    mask, _ = _unmasked()
    return {"q": res["q"], "k": kc, "v": vc, "mask": mask, "out": res["out"], "lse": res["lse"]}


def _backward(res, g, *, axis_name, causal, scale, bq, bk):
    R, i, rotate = _ring(axis_name)
    q, k, v = res["q"], res["k"], res["v"]
    acc = compute_dtype(q.dtype)
    static = _kernel_static(scale, bq, bk)

    def grads(kc, vc, src):
        def attend(is_causal):
            def run():
                d = _attn._backward(_block_res(res, kc, vc), g, causal=is_causal, **static)
                return tuple(x.astype(acc) for x in d)

            return run

        def skip():
            return tuple(jnp.zeros(x.shape, acc) for x in (q, kc, vc))

        return _switch(_case(causal, src, i), [attend(False), attend(True), skip], axis_name)

    dq, dk, dv = grads(k, v, i)

    def step(carry, s):
        dq, kc, vc, dk, dv = carry
        kc, vc, dk, dv = rotate(kc), rotate(vc), rotate(dk), rotate(dv)
        a, b, c = grads(kc, vc, (i - s) % R)
        return (dq + a, kc, vc, dk + b, dv + c), None

    init = varying_like((dq, k, v, dk, dv), res, g, axes=(axis_name,))
    (dq, _, _, dk, dv), _ = lax.scan(step, init, jnp.arange(1, R))
    dk, dv = rotate(dk), rotate(dv)  # the accumulators of each block back to its device
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _tangent(res, tq, tk, tv, *, axis_name, causal, scale, bq, bk):
    R, i, rotate = _ring(axis_name)
    q, k, v = res["q"], res["k"], res["v"]
    acc = compute_dtype(q.dtype)
    static = _kernel_static(scale, bq, bk)

    def part(kc, vc, tkc, tvc, src):
        def attend(is_causal):
            def run():
                r = _block_res(res, kc, vc)
                return _attn._tangent(r, tq, tkc, tvc, causal=is_causal, **static).astype(acc)

            return run

        def skip():
            return jnp.zeros(q.shape, acc)

        return _switch(_case(causal, src, i), [attend(False), attend(True), skip], axis_name)

    dout = part(k, v, tk, tv, i)

    def step(carry, s):
        dout, kc, vc, tkc, tvc = carry
        kc, vc, tkc, tvc = rotate(kc), rotate(vc), rotate(tkc), rotate(tvc)
        return (dout + part(kc, vc, tkc, tvc, (i - s) % R), kc, vc, tkc, tvc), None

    init = varying_like((dout, k, v, tk, tv), res, tq, tk, tv, axes=(axis_name,))
    (dout, *_), _ = lax.scan(step, init, jnp.arange(1, R))
    return dout.astype(tq.dtype)


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
