"""Memory-efficient dot-product attention: blockwise online softmax, FlashAttention-2 backward.

Shape letters (as in :func:`jax.nn.dot_product_attention`): ``B`` batch, ``T`` query
length, ``S`` key length, ``N`` query heads, ``K`` key/value heads (``K`` divides ``N``:
grouped-query attention, query head ``n`` reads key/value head ``n // (N // K)``), ``H``
head dimension.

The forward visits the ``(query block, key block)`` pairs that are not entirely masked
(a causal mask skips the blocks above the diagonal) in one ``lax.scan`` and keeps a
running row maximum ``m``, normalizer ``l`` and unnormalized output per query row (the
online softmax). It saves ``q, k, v``, the output and the per-row logsumexp
``lse = m + log l``: nothing of size ``T x S``. The backward and the tangent rule
recompute the probabilities block by block from ``lse``. See ``docs/attention.md``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.export import is_symbolic_dim
from jax.typing import ArrayLike

from cannjax._src.core.dtypes import compute_dtype
from cannjax._src.core.operator import defop, registered
from cannjax._src.core.registry import EdgeCase, Level
from cannjax._src.core.validate import as_float

_FN = "cannjax.ops.attention"

# (query block, key block) per platform. CPU: 128 x 128, from benchmarks/attention.py
# --blocks (fwd+bwd at B=1, N=8, H=64, causal; docs/attention.md): it was the fastest of
# the sizes tried on a loaded machine (smaller blocks pay the scan's per-step overhead),
# and no other size beat it by more than the run-to-run spread on an idle one, so it
# stays the default (the figures are in docs/performance.md).
# GPU: the usual FlashAttention tiles, untuned.
_BLOCKS = {"cpu": (128, 128), "gpu": (128, 128), "cuda": (128, 128), "rocm": (128, 128)}
_DEFAULT_BLOCKS = (128, 128)


def attention_block_sizes(platform: str | None = None) -> tuple[int, int]:
    """The default ``(block_q, block_k)`` of :func:`attention` on ``platform``.

    Args:
      platform: a JAX platform name (``"cpu"``, ``"gpu"``...); the default backend's when
        None.

    Returns:
      ``(block_q, block_k)``: query rows and key columns processed per step.

    Example:
      >>> from cannjax.ops import attention_block_sizes
      >>> attention_block_sizes("cpu")
      (128, 128)
    """
    return _BLOCKS.get(platform or jax.default_backend(), _DEFAULT_BLOCKS)


_LAYOUT = {"q": "[B, T, N, H]", "k": "[B, S, K, H]", "v": "[B, S, K, H]"}


def _check_shapes(q, k, v):
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 4:
            raise ValueError(
                f"{_FN}: {name} must have rank 4 ({_LAYOUT[name]}), got shape {a.shape}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{_FN}: q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}; "
            "cast them to one dtype first"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"{_FN}: k and v must have the same shape [B, S, K, H], got k.shape={k.shape} "
            f"and v.shape={v.shape}"
        )
    (B, T, N, H), (Bk, S, K, Hk) = q.shape, k.shape
    if B != Bk:
        raise ValueError(
            f"{_FN}: q and k must have the same batch size, got q.shape={q.shape} "
            f"and k.shape={k.shape}"
        )
    if H != Hk:
        raise ValueError(
            f"{_FN}: q and k must have the same head dimension H, got q.shape={q.shape} "
            f"(H={H}) and k.shape={k.shape} (H={Hk})"
        )
    if K == 0 or N % K:
        raise ValueError(
            f"{_FN}: the number of key/value heads K={K} must divide the number of query "
            f"heads N={N} (q.shape={q.shape}, k.shape={k.shape})"
        )
    if T == 0 or S == 0 or H == 0:
        raise ValueError(f"{_FN}: empty inputs, got q.shape={q.shape} and k.shape={k.shape}")


def _block(value, default, length, name):
    if value is None:
        value = default
    elif isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{_FN}: {name} must be an int or None, got {value!r}")
    elif value < 1:
        raise ValueError(f"{_FN}: {name} must be >= 1, got {value}")
    # A symbolic length (jax.export) cannot be compared with the block size: the block
    # stays as given and the length is padded to a whole number of blocks.
    return int(value) if is_symbolic_dim(length) else min(int(value), length)


def _is_one(d):
    """Whether a mask dimension broadcasts (size 1); a symbolic dimension never does."""
    return not is_symbolic_dim(d) and d == 1


def _cdiv(a, b):
    """``ceil(a / b)`` for ``b > 0``, for int or symbolic ``a``."""
    return (a + b - 1) // b


def _as_mask(mask, full):
    if mask is None:
        return jnp.ones((1, 1, 1, 1), bool)
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(
            f"{_FN}: mask must be a boolean array (True = attend), got {mask.dtype}"
            f"{list(mask.shape)}; use mask.astype(bool)"
        )
    if mask.ndim > 4:
        raise ValueError(
            f"{_FN}: mask must be broadcastable to [B, N, T, S] = {list(full)}, got shape "
            f"{mask.shape} (rank {mask.ndim} > 4)"
        )
    shape = (1,) * (4 - mask.ndim) + mask.shape
    if any(d not in (1, f) for d, f in zip(shape, full)):
        raise ValueError(
            f"{_FN}: mask of shape {mask.shape} does not broadcast to [B, N, T, S] = "
            f"{list(full)}; each dimension must be 1 or the full size"
        )
    return mask.reshape(shape)


# ------------------------------------------------------------------------------ layout
# Inside the rules: q as [B, K, G, T, H] (query head n = kv head n // G, group n % G),
# k and v as [B, K, S, H], padded to whole blocks. A query block is reshaped to
# [B, K, G * bq, H], so every product is a matmul batched over (B, K).


def _geometry(q, k, bq, bk):
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    nq, nk = _cdiv(T, bq), _cdiv(S, bk)
    return B, T, N, H, S, K, N // K, nq, nk


def _group_q(x, K, G, Tp):
    """``[B, T, N, X]`` -> ``[B, K, G, Tp, X]`` (zero-padded to ``Tp`` rows)."""
    B, T, N, X = x.shape
    x = jnp.transpose(x.reshape(B, T, K, G, X), (0, 2, 3, 1, 4))
    return _pad_axis(x, 3, Tp)


def _ungroup_q(x, T):
    """``[B, K, G, Tp, X]`` -> ``[B, T, N, X]``."""
    B, K, G, _, X = x.shape
    return jnp.transpose(x[:, :, :, :T], (0, 3, 1, 2, 4)).reshape(B, T, K * G, X)


def _group_kv(x, Sp):
    """``[B, S, K, H]`` -> ``[B, K, Sp, H]``."""
    return _pad_axis(jnp.transpose(x, (0, 2, 1, 3)), 2, Sp)


def _pad_axis(x, axis, size):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _group_mask(mask, K, G, Tp, Sp):
    """``[Bm, Nm, Tm, Sm]`` (dims 1 or full) -> ``[Bm, Km, Gm, Tm', Sm']``, padded."""
    Bm, Nm, Tm, Sm = mask.shape
    mask = mask.reshape(Bm, 1, 1, Tm, Sm) if _is_one(Nm) else mask.reshape(Bm, K, G, Tm, Sm)
    if not _is_one(Tm):
        mask = _pad_axis(mask, 3, Tp)
    if not _is_one(Sm):
        mask = _pad_axis(mask, 4, Sp)  # padded keys: False
    return mask


def _pairs(T, S, bq, bk, nq, nk, causal, has_mask):
    """The block pairs to visit, split into (clean, masked) lists of (i, j) arrays.

    A pair is skipped when the causal mask hides all of it; it is "clean" when no mask
    applies inside it (no user mask, entirely below the diagonal, no padded keys).
    """
    clean, masked = [], []
    for i in range(nq):
        q_lo, q_hi = i * bq, min((i + 1) * bq, T) - 1
        for j in range(nk):
            k_lo, k_hi = j * bk, (j + 1) * bk - 1
            if causal and k_lo > q_hi:
                continue
            needs = has_mask or k_hi >= S or (causal and k_hi > q_lo)
            (masked if needs else clean).append((i, j))

    def arr(ps):
        a = np.asarray(ps, np.int32).reshape(-1, 2)
        return jnp.asarray(a[:, 0]), jnp.asarray(a[:, 1])

    return arr(clean), arr(masked)


class _Ctx:
    """Static geometry and block accessors shared by the three rules.

    With a symbolic length (``jax.export``), the block counts are symbolic too and the
    visited pairs cannot be listed while tracing: ``scan_pairs`` then walks every pair.
    """

    def __init__(self, q, k, mask, *, causal, scale, bq, bk, has_mask):
        B, T, N, H, S, K, G, nq, nk = _geometry(q, k, bq, bk)
        self.B, self.T, self.N, self.H, self.S, self.K, self.G = B, T, N, H, S, K, G
        self.bq, self.bk, self.nq, self.nk = bq, bk, nq, nk
        self.Tp, self.Sp = nq * bq, nk * bk
        self.causal, self.scale, self.has_mask = causal, scale, has_mask
        # Accumulation dtype: float32 for half precision and float32, float64 for float64.
        self.acc = compute_dtype(q.dtype)
        self.mask = _group_mask(mask, K, G, self.Tp, self.Sp) if has_mask else None
        self.symbolic = is_symbolic_dim(T) or is_symbolic_dim(S)
        if not self.symbolic:
            self.clean, self.masked = _pairs(T, S, bq, bk, nq, nk, causal, has_mask)

    # q-side arrays are [B, K, G, Tp, X] (or stats [B, K, G, Tp]); kv-side [B, K, Sp, H].
    def qrows(self, x, i):
        """Block ``i`` of a q-side array, rows flattened: ``[B, K, G * bq, ...]``."""
        blk = lax.dynamic_slice_in_dim(x, i * self.bq, self.bq, axis=3)
        return blk.reshape(blk.shape[:2] + (self.G * self.bq,) + blk.shape[4:])

    def put_qrows(self, x, i, blk):
        blk = blk.reshape(x.shape[:3] + (self.bq,) + x.shape[4:])
        return lax.dynamic_update_slice_in_dim(x, blk.astype(x.dtype), i * self.bq, axis=3)

    def kcols(self, x, j):
        return lax.dynamic_slice_in_dim(x, j * self.bk, self.bk, axis=2)

    def put_kcols(self, x, j, blk):
        return lax.dynamic_update_slice_in_dim(x, blk.astype(x.dtype), j * self.bk, axis=2)

    def valid(self, i, j):
        """Boolean ``[.., G * bq, bk]`` of the entries of pair ``(i, j)`` to attend."""
        G, bq, bk = self.G, self.bq, self.bk
        rows = i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
        cols = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        ok = jnp.ones((bq, bk), bool)
        if self.causal:
            ok = ok & (cols <= rows)
        if self.symbolic or self.Sp != self.S:
            ok = ok & (cols < self.S)
        ok = ok.reshape(1, 1, 1, bq, bk)
        if self.has_mask:
            m = self.mask
            if not _is_one(m.shape[3]):
                m = lax.dynamic_slice_in_dim(m, i * bq, bq, axis=3)
            if not _is_one(m.shape[4]):
                m = lax.dynamic_slice_in_dim(m, j * bk, bk, axis=4)
            ok = ok & m
        ok = jnp.broadcast_to(ok, ok.shape[:2] + (G, bq, bk))
        return ok.reshape(ok.shape[:2] + (G * bq, bk))

    def logits(self, qb, kb, i, j, masked):
        """``scale * q k^T`` in float32 for one pair; masked entries ``-inf``."""
        s = jnp.einsum("bkqh,bksh->bkqs", qb, kb, preferred_element_type=self.acc)
        s = s * self.scale
        if masked:
            s = jnp.where(self.valid(i, j), s, -jnp.inf)
        return s

    def scan_pairs(self, body, carry):
        """Runs ``body(carry, i, j, masked)`` over every visited pair."""
        if self.symbolic:
            return self._scan_symbolic(body, carry)
        for (ii, jj), masked in ((self.clean, False), (self.masked, True)):
            if ii.shape[0] == 0:
                continue

            def step(c, ij, masked=masked):
                return body(c, ij[0], ij[1], masked), None

            carry, _ = lax.scan(step, carry, (ii, jj))
        return carry

    def _scan_symbolic(self, body, carry):
        # nq * nk pairs in row-major order, each masked (padded keys, causal diagonal and
        # user mask alike); under a causal mask, a pair above the diagonal is skipped by
        # lax.cond, as the static path skips it when listing the pairs. A scan (not a
        # while loop) with a symbolic trip count, so that it transposes like the static one.
        nq, nk, bq, bk, T = self.nq, self.nk, self.bq, self.bk, self.T

        def step(c, p):
            i, j = p // nk, p % nk
            if not self.causal:
                return body(c, i, j, True), None
            hidden = j * bk > jnp.minimum((i + 1) * bq, T) - 1
            return lax.cond(hidden, lambda c: c, lambda c: body(c, i, j, True), c), None

        carry, _ = lax.scan(step, carry, jnp.arange(nq * nk, dtype=jnp.int32))
        return carry


# ------------------------------------------------------------------------------ attention
def _forward(q, k, v, mask, *, causal, scale, bq, bk, has_mask):
    c = _Ctx(q, k, mask, causal=causal, scale=scale, bq=bq, bk=bk, has_mask=has_mask)
    qg = _group_q(q, c.K, c.G, c.Tp)
    kg, vg = _group_kv(k, c.Sp), _group_kv(v, c.Sp)
    stat = (c.B, c.K, c.G, c.Tp)
    m0 = jnp.full(stat, -jnp.inf, c.acc)
    l0 = jnp.zeros(stat, c.acc)
    acc0 = jnp.zeros(stat + (c.H,), c.acc)

    # Online softmax: for each visited pair, with m the running row max,
    #   m' = max(m, max_j s),  l' = e^(m - m') l + sum_j e^(s - m'),
    #   acc' = e^(m - m') acc + e^(s - m') v.
    # A row with nothing to attend so far has m = -inf; its exponent base is taken as 0
    # so that masked entries (s = -inf) give e^(-inf) = 0, never -inf - (-inf) = NaN.
    def body(carry, i, j, masked):
        m, den, acc = carry
        qb, kb, vb = c.qrows(qg, i), c.kcols(kg, j), c.kcols(vg, j)
        s = c.logits(qb, kb, i, j, masked)
        m_old, l_old, acc_old = c.qrows(m, i), c.qrows(den, i), c.qrows(acc, i)
        m_new = jnp.maximum(m_old, s.max(-1))
        base = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        p = jnp.exp(s - base[..., None])
        alpha = jnp.exp(m_old - base)
        l_new = alpha * l_old + p.sum(-1)
        pv = jnp.einsum("bkqs,bksh->bkqh", p.astype(vb.dtype), vb, preferred_element_type=c.acc)
        acc_new = alpha[..., None] * acc_old + pv
        return c.put_qrows(m, i, m_new), c.put_qrows(den, i, l_new), c.put_qrows(acc, i, acc_new)

    m, den, acc = c.scan_pairs(body, (m0, l0, acc0))
    # Rows with nothing to attend (l = 0): output 0 and lse = +inf, so that the
    # backward's e^(s - lse) is 0 there without a branch.
    seen = den > 0
    l_safe = jnp.where(seen, den, 1.0)
    out = jnp.where(seen[..., None], acc / l_safe[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(l_safe), jnp.inf)
    out = _ungroup_q(out, c.T).astype(q.dtype)
    lse = lse[:, :, :, : c.T].reshape(c.B, c.N, c.T)
    return out, {"q": q, "k": k, "v": v, "out": out, "lse": lse, "mask": mask}


def _prepare(res, c):
    qg = _group_q(res["q"], c.K, c.G, c.Tp)
    kg, vg = _group_kv(res["k"], c.Sp), _group_kv(res["v"], c.Sp)
    lse = res["lse"].reshape(c.B, c.K, c.G, c.T)
    lse = jnp.pad(lse, [(0, 0)] * 3 + [(0, c.Tp - c.T)], constant_values=jnp.inf)
    return qg, kg, vg, lse


def _probs(c, s, lse_b):
    # p = e^(s - lse): exact softmax probabilities given the saved per-row lse.
    return jnp.exp(s - lse_b[..., None])


def _backward(res, g, *, causal, scale, bq, bk, has_mask):
    # FlashAttention-2: with P = softmax(S), O = P V and dO given,
    #   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D),  D = rowsum(dO * O) = rowsum(P * dP),
    #   dQ = scale dS K,  dK = scale dS^T Q.
    # D is computed first, from O, so each pair needs only its own block of P.
    q, k, v = res["q"], res["k"], res["v"]
    c = _Ctx(q, k, res["mask"], causal=causal, scale=scale, bq=bq, bk=bk, has_mask=has_mask)
    qg, kg, vg, lse = _prepare(res, c)
    dog = _group_q(g, c.K, c.G, c.Tp)
    d = jnp.sum(dog.astype(c.acc) * _group_q(res["out"], c.K, c.G, c.Tp).astype(c.acc), -1)
    dq0 = jnp.zeros(qg.shape, c.acc)
    dk0 = jnp.zeros(kg.shape, c.acc)
    dv0 = jnp.zeros(vg.shape, c.acc)

    def body(carry, i, j, masked):
        dq, dk, dv = carry
        qb, kb, vb = c.qrows(qg, i), c.kcols(kg, j), c.kcols(vg, j)
        dob = c.qrows(dog, i)
        p = _probs(c, c.logits(qb, kb, i, j, masked), c.qrows(lse, i))
        dvb = jnp.einsum("bkqs,bkqh->bksh", p.astype(dob.dtype), dob, preferred_element_type=c.acc)
        dp = jnp.einsum("bkqh,bksh->bkqs", dob, vb, preferred_element_type=c.acc)
        ds = p * (dp - c.qrows(d, i)[..., None]) * scale
        dqb = jnp.einsum("bkqs,bksh->bkqh", ds.astype(kb.dtype), kb, preferred_element_type=c.acc)
        dkb = jnp.einsum("bkqs,bkqh->bksh", ds.astype(qb.dtype), qb, preferred_element_type=c.acc)
        dq = c.put_qrows(dq, i, c.qrows(dq, i) + dqb)
        dk = c.put_kcols(dk, j, c.kcols(dk, j) + dkb)
        dv = c.put_kcols(dv, j, c.kcols(dv, j) + dvb)
        return dq, dk, dv

    dq, dk, dv = c.scan_pairs(body, (dq0, dk0, dv0))
    dq = _ungroup_q(dq, c.T).astype(q.dtype)
    dk = jnp.transpose(dk[:, :, : c.S], (0, 2, 1, 3)).astype(k.dtype)
    dv = jnp.transpose(dv[:, :, : c.S], (0, 2, 1, 3)).astype(v.dtype)
    return dq, dk, dv


def _tangent(res, tq, tk, tv, *, causal, scale, bq, bk, has_mask):
    # With dS = scale (dQ K^T + Q dK^T) and P = softmax(S):
    #   dP = P * (dS - c),  c = rowsum(P * dS),
    #   dO = P dV + dP V = [P dV + (P * dS) V] - c O,
    # accumulated pair by pair from the saved lse (linear in dQ, dK, dV).
    q, k = res["q"], res["k"]
    c = _Ctx(q, k, res["mask"], causal=causal, scale=scale, bq=bq, bk=bk, has_mask=has_mask)
    qg, kg, vg, lse = _prepare(res, c)
    tqg = _group_q(tq, c.K, c.G, c.Tp)
    tkg, tvg = _group_kv(tk, c.Sp), _group_kv(tv, c.Sp)
    stat = (c.B, c.K, c.G, c.Tp)
    acc0 = jnp.zeros(stat + (c.H,), c.acc)
    rs0 = jnp.zeros(stat, c.acc)

    def body(carry, i, j, masked):
        acc, rs = carry
        qb, kb, vb = c.qrows(qg, i), c.kcols(kg, j), c.kcols(vg, j)
        tqb, tkb, tvb = c.qrows(tqg, i), c.kcols(tkg, j), c.kcols(tvg, j)
        p = _probs(c, c.logits(qb, kb, i, j, masked), c.qrows(lse, i))
        ds = jnp.einsum("bkqh,bksh->bkqs", tqb, kb, preferred_element_type=c.acc)
        ds = ds + jnp.einsum("bkqh,bksh->bkqs", qb, tkb, preferred_element_type=c.acc)
        pds = p * ds * scale
        a = jnp.einsum("bkqs,bksh->bkqh", p.astype(tvb.dtype), tvb, preferred_element_type=c.acc)
        a = a + jnp.einsum(
            "bkqs,bksh->bkqh", pds.astype(vb.dtype), vb, preferred_element_type=c.acc
        )
        acc = c.put_qrows(acc, i, c.qrows(acc, i) + a)
        rs = c.put_qrows(rs, i, c.qrows(rs, i) + pds.sum(-1))
        return acc, rs

    acc, rs = c.scan_pairs(body, (acc0, rs0))
    out = _group_q(res["out"], c.K, c.G, c.Tp).astype(c.acc)
    return _ungroup_q(acc - rs[..., None] * out, c.T).astype(tq.dtype)


# The rules are jitted so that eager calls (and the many small calls of check_op) reuse
# compiled scans instead of retracing them; under an outer trace jit is simply inlined.
_STATIC = ("causal", "scale", "bq", "bk", "has_mask")
_attention = defop(
    "attention",
    forward=jax.jit(_forward, static_argnames=_STATIC),
    tangent=jax.jit(_tangent, static_argnames=_STATIC),
    backward=jax.jit(_backward, static_argnames=_STATIC),
    nondiff_argnums=(3,),
    residuals={
        "q": "the queries [B, T, N, H] (an input)",
        "k": "the keys [B, S, K, H] (an input)",
        "v": "the values [B, S, K, H] (an input)",
        "out": "the output [B, T, N, H]",
        "lse": "per-row logsumexp of the logits [B, N, T], float32 (+inf: no key)",
        "mask": "the boolean mask as given (one element when None)",
    },
    level=Level.DERIVED,
    reuse=(),
)


def _reference(q, k, v, *, causal=False, mask=None, scale=None, block_q=None, block_k=None):
    """Plain-jnp attention, as ``jax.nn.dot_product_attention`` computes it.

    Differences: computed in the inputs' precision (jax's softmax is always float32,
    which would make a float64 reference float32-accurate), and query rows with no key
    to attend give 0 (jax's give the mean of ``v``). tests/test_attention.py checks it
    against ``jax.nn.dot_product_attention`` itself.
    """
    del block_q, block_k
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    qg = q.reshape(B, T, K, N // K, H)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k) * scale
    attend = jnp.ones((1, 1, T, S), bool)
    if mask is not None:
        mask = jnp.asarray(mask)
        attend = attend & mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    if causal:
        attend = attend & jnp.tril(jnp.ones((T, S), bool))[None, None]
    attend = jnp.broadcast_to(attend, (B, N, T, S)).reshape(B, K, N // K, T, S)
    p = jax.nn.softmax(jnp.where(attend, s, -0.7 * jnp.finfo(s.dtype).max), axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", p, v).reshape(B, T, N, H)
    any_key = jnp.transpose(attend.any(-1).reshape(B, N, T), (0, 2, 1))[..., None]
    return jnp.where(any_key, out, jnp.zeros((), out.dtype))


def _sample(key):
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (1, 5, 4, 3), jnp.float32)
    k = jax.random.normal(kk, (1, 7, 2, 3), jnp.float32)
    v = jax.random.normal(kv, (1, 7, 2, 3), jnp.float32)
    return q, k, v


def _edges():
    q, k, v = _sample(jax.random.key(7))
    # Query rows 1 and 3 attend nothing: output 0, gradient 0.
    mask = jnp.ones((1, 1, 5, 7), bool).at[:, :, 1].set(False).at[:, :, 3].set(False)
    # Large logits (|s| up to ~40: softmax close to one-hot). Logits beyond exp's range
    # are tested in tests/test_attention.py: there float32 gradients agree with the
    # reference only to ~eps * |s| (dS = P * (dP - D) cancels), too loose for check_op.
    big = q * 8.0
    return [
        EdgeCase((q, k, v), kwargs={"mask": mask, "block_q": 2, "block_k": 3}),
        EdgeCase((q, k, v), kwargs={"mask": jnp.zeros((5, 7), bool)}),
        # Gradients here agree to ~eps * |s| (|s| ~ 40): an absolute 1e-5, not 1e-6.
        EdgeCase((big, k, v), kwargs={"causal": True, "block_q": 2, "block_k": 2}, atol=1e-5),
    ]


# The operator's argument 3 is the mask; the public function takes it by keyword, so
# all of its positional arguments (q, k, v) are differentiated.
@registered(
    _attention,
    nondiff_argnums=(),
    reference=_reference,
    sample=_sample,
    configs=(
        {},
        {"causal": True},
        {"causal": True, "block_q": 2, "block_k": 3},
        {"block_q": 3, "block_k": 2},
    ),
    edges=_edges,
    doc="Memory-efficient scaled dot-product attention (online softmax, FA-2 backward).",
)
def attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    causal: bool = False,
    mask: ArrayLike | None = None,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> jax.Array:
    """Scaled dot-product attention that never materializes the ``T x S`` matrix.

    Same math as ``jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
    scale=scale)``::

      s[b, n, t, j] = scale * sum_h q[b, t, n, h] k[b, j, n // G, h]   (G = N // K)
      p = softmax_j(s)  over the keys j with mask[b, n, t, j] (and j <= t if causal)
      out[b, t, n, h] = sum_j p[b, n, t, j] v[b, j, n // G, h]

    except that a query row with no key to attend gives output 0 and gradient 0 (jax's
    gives the mean of ``v`` there). The forward keeps ``q, k, v``, the output and the
    per-row logsumexp (``B N T`` floats); the backward recomputes ``p`` block by block
    (FlashAttention-2). Memory beyond inputs and outputs is ``O(block_q * block_k)`` per
    head instead of ``O(T * S)``.

    Args:
      q: queries ``[B, T, N, H]``, floating point.
      k: keys ``[B, S, K, H]``, same dtype as ``q``; ``K`` divides ``N``.
      v: values ``[B, S, K, H]``, same dtype as ``q``.
      causal: query ``t`` attends only keys ``j <= t`` (top-left aligned, as jax's).
      mask: optional boolean array broadcastable to ``[B, N, T, S]``; True = attend.
        Not differentiated.
      scale: multiplies the logits; ``1 / sqrt(H)`` when None.
      block_q: query rows per block; :func:`attention_block_sizes` when None. At most
        ``T``, except under ``jax.export`` with a symbolic ``T``, where the queries are
        padded to a whole number of blocks instead.
      block_k: key columns per block; :func:`attention_block_sizes` when None. Likewise
        at most ``S``, unless ``S`` is symbolic.

    Returns:
      ``[B, T, N, H]`` array of ``q``'s dtype.

    Raises:
      TypeError: non-floating or mismatched dtypes, a non-boolean mask, or a non-int
        block size.
      ValueError: inputs not of rank 4, mismatched batch, length or head dimensions,
        ``K`` not dividing ``N``, a mask that does not broadcast to ``[B, N, T, S]``, a
        block size < 1, or ``scale=None`` with a symbolic head dimension ``H`` (under
        ``jax.export``; symbolic ``B``, ``T`` and ``S`` are supported, docs/export.md).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from cannjax.ops import attention
      >>> q = k = v = jnp.ones((1, 4, 2, 8))
      >>> attention(q, k, v, causal=True).shape
      (1, 4, 2, 8)
      >>> g = jax.grad(lambda q: attention(q, k, v, causal=True).sum())(q)
      >>> bool(jnp.isfinite(g).all())
      True

    References:
      Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
      Partitioning", 2023. https://arxiv.org/abs/2307.08691
      Rabe and Staats, "Self-attention Does Not Need O(n^2) Memory", 2021.
      https://arxiv.org/abs/2112.05682
      Huawei CANN operator FlashAttentionScore
      Huawei CANN operator FlashAttentionScoreGrad
    """
    q = as_float(_FN, "q", q)
    k = as_float(_FN, "k", k)
    v = as_float(_FN, "v", v)
    _check_shapes(q, k, v)
    B, T, N, H = q.shape
    S = k.shape[1]
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{_FN}: causal must be a bool, got {causal!r}")
    if scale is None:
        if is_symbolic_dim(H):
            raise ValueError(
                f"{_FN}: the default scale 1 / sqrt(H) needs a constant head dimension, "
                f"but H = q.shape[3] is symbolic ({H}); pass scale explicitly"
            )
        scale = 1.0 / math.sqrt(H)
    elif isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.floating)):
        raise TypeError(f"{_FN}: scale must be a Python float (static), got {scale!r}")
    dq, dk = attention_block_sizes()
    bq = _block(block_q, dq, T, "block_q")
    bk = _block(block_k, dk, S, "block_k")
    has_mask = mask is not None
    mask = _as_mask(mask, (B, N, T, S))
    return _attention(
        q, k, v, mask, causal=bool(causal), scale=float(scale), bq=bq, bk=bk, has_mask=has_mask
    )
