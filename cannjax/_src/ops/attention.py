"""Memory-efficient dot-product attention: blockwise online softmax, FlashAttention-2 backward.

Shape letters (as in :func:`jax.nn.dot_product_attention`): ``B`` batch, ``T`` query
length, ``S`` key length, ``N`` query heads, ``K`` key/value heads (``K`` divides ``N``:
grouped-query attention, query head ``n`` reads key/value head ``n // (N // K)``), ``H``
head dimension.

The logits of one ``(query block, key block)`` pair are ``scale * q k^T``, soft-capped
(``cap * tanh(s / cap)``, Gemma 2) when ``logit_cap`` is given, plus an additive
``bias``, then masked (boolean ``mask``, ``causal``, sliding ``window``, packed
``segment_ids``). The forward visits the pairs that are not entirely masked in one
``lax.scan`` and keeps a running row maximum ``m``, normalizer ``l`` and unnormalized
output per query row (the online softmax). Pairs hidden by ``causal`` or ``window`` are
dropped while tracing; pairs whose query and key blocks share no segment id are skipped
at run time by a ``lax.cond`` (the ids are values, not shapes). The forward saves ``q, k,
v``, the bias, masks and ids as given, the output and the per-row logsumexp
``lse = m + log l``: nothing of size ``T x S`` that the caller did not pass. The backward
and the tangent rule recompute the probabilities block by block from ``lse``. See
``docs/attention.md``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.export import is_symbolic_dim
from jax.typing import ArrayLike

from cannjax._src.core import dots, half_bits
from cannjax._src.core.dtypes import compute_dtype
from cannjax._src.core.operator import defop, registered
from cannjax._src.core.partitioned import HeadsLayout, bound, needs_devices, row_local
from cannjax._src.core.registry import EdgeCase, Level
from cannjax._src.core.validate import as_float
from cannjax._src.core.vma import varying_like

_FN = "cannjax.ops.attention"

# (query block, key block) per platform. CPU: 128 x 128, from benchmarks/attention.py
# --blocks (fwd+bwd at B=1, N=8, H=64, causal; docs/attention.md): it was the fastest of
# the sizes tried on a loaded machine (smaller blocks pay the scan's per-step overhead),
# and no other size beat it by more than the run-to-run spread on an idle one, so it
# stays the default (the figures are in docs/performance.md).
# GPU: the usual FlashAttention tiles, untuned.
_BLOCKS = {"cpu": (128, 128), "gpu": (128, 128), "cuda": (128, 128), "rocm": (128, 128)}
_DEFAULT_BLOCKS = (128, 128)
# A window side at least this wide never hides a key (any position difference fits in
# int32 arithmetic below it); wider sides are clipped to it.
_WIDE = 2**30


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
    (B, _, N, H), (Bk, _, K, Hk) = q.shape, k.shape
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


def _as_4d(x, name, full, what):
    """``x`` (rank <= 4) reshaped to rank 4, each dimension 1 or that of ``full``."""
    if x.ndim > 4:
        raise ValueError(
            f"{_FN}: {name} must be broadcastable to [B, N, T, S] = {list(full)}, got shape "
            f"{x.shape} (rank {x.ndim} > 4)"
        )
    shape = (1,) * (4 - x.ndim) + x.shape
    if any(d not in (1, f) for d, f in zip(shape, full)):
        raise ValueError(
            f"{_FN}: {name} of shape {x.shape} does not broadcast to [B, N, T, S] = "
            f"{list(full)}; each dimension must be 1 or the full size{what}"
        )
    return x.reshape(shape)


def _as_mask(mask, full):
    if mask is None:
        return jnp.ones((1, 1, 1, 1), bool)
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(
            f"{_FN}: mask must be a boolean array (True = attend), got {mask.dtype}"
            f"{list(mask.shape)}; use mask.astype(bool)"
        )
    return _as_4d(mask, "mask", full, "")


def _as_bias(bias, full):
    if isinstance(bias, (bool, np.bool_)) or getattr(bias, "dtype", None) == jnp.bool_:
        raise TypeError(
            f"{_FN}: bias must be a floating-point array (added to the logits), got a "
            "boolean; pass a boolean mask as mask= (True = attend)"
        )
    bias = as_float(_FN, "bias", bias)
    return _as_4d(bias, "bias", full, " (use a [1, N, T, S] bias shared by the batch)")


def _as_cap(cap):
    if cap is None:
        return None
    if isinstance(cap, (bool, np.bool_)) or not isinstance(
        cap, (int, float, np.integer, np.floating)
    ):
        raise TypeError(
            f"{_FN}: logit_cap must be a Python float > 0 (static) or None, got {cap!r}"
        )
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"{_FN}: logit_cap must be a finite float > 0, got {cap!r}")
    return float(cap)


def _as_window(window):
    """``window`` as ``(left, right)`` ints >= 0 (an int ``w`` is ``(w, w)``), or None."""
    if window is None:
        return None

    def is_int(w):
        return isinstance(w, (int, np.integer)) and not isinstance(w, (bool, np.bool_))

    if is_int(window):
        window = (window, window)
    elif not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(
            f"{_FN}: window must be an int or a pair (left, right) of ints, got {window!r}"
        )
    if not all(is_int(w) for w in window):
        raise TypeError(f"{_FN}: window must hold Python ints (static), got {window!r}")
    if min(window) < 0:
        raise ValueError(
            f"{_FN}: window sides must be >= 0 (query t attends keys t - left ... "
            f"t + right), got {tuple(int(w) for w in window)}"
        )
    return tuple(min(int(w), _WIDE) for w in window)


def _as_segments(segment_ids, B, T, S):
    """``(q_ids [B, T], kv_ids [B, S])`` integer arrays, or None."""
    if segment_ids is None:
        return None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(
                f"{_FN}: segment_ids must be one [B, T] array or a pair (q_segment_ids "
                f"[B, T], kv_segment_ids [B, S]), got a sequence of {len(segment_ids)}"
            )
        pair = [jnp.asarray(s) for s in segment_ids]
        names = ("segment_ids[0] (the query ids)", "segment_ids[1] (the key/value ids)")
    else:
        pair = [jnp.asarray(segment_ids)] * 2
        names = ("segment_ids",) * 2
    for ids, name in zip(pair, names):
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(
                f"{_FN}: {name} must be an integer array, got {ids.dtype}{list(ids.shape)}; "
                "use ids.astype(jnp.int32)"
            )
    if not isinstance(segment_ids, (tuple, list)) and T != S:
        raise ValueError(
            f"{_FN}: one segment_ids array is shared by queries and keys and needs T == S, "
            f"got T={T} and S={S}; pass a pair (q_segment_ids [B, T], kv_segment_ids [B, S])"
        )
    for ids, name, L, letter in zip(pair, names, (T, S), ("T", "S")):
        if ids.ndim != 2 or ids.shape[0] != B or ids.shape[1] != L:
            raise ValueError(
                f"{_FN}: {name} must have shape [B, {letter}] = {[B, L]}, got {ids.shape}"
            )
    return pair


# ------------------------------------------------------------------------------ layout
# Inside the rules: q as [B, K, G, T, H] (query head n = kv head n // G, group n % G),
# k and v as [B, K, S, H], padded to whole blocks. A query block is reshaped to
# [B, K, G * bq, H], so every product is a matmul batched over (B, K). Masks and biases
# are [Bm, Km, Gm, Tm, Sm], each dimension 1 or full.


def _rounded(dtype):
    """Whether operands of ``dtype`` are narrower than the kernel's accumulation dtype
    (half precision): their probabilities and output are then rounded."""
    return compute_dtype(dtype) != jnp.dtype(dtype)


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


def _group_bnts(x, K, G, Tp, Sp):
    """``[Bm, Nm, Tm, Sm]`` (dims 1 or full) -> ``[Bm, Km, Gm, Tm', Sm']``, zero-padded."""
    Bm, Nm, Tm, Sm = x.shape
    x = x.reshape(Bm, 1, 1, Tm, Sm) if _is_one(Nm) else x.reshape(Bm, K, G, Tm, Sm)
    if not _is_one(Tm):
        x = _pad_axis(x, 3, Tp)
    if not _is_one(Sm):
        x = _pad_axis(x, 4, Sp)  # padded keys: False / 0 (they are masked anyway)
    return x


def _ungroup_bnts(x, shape):
    """The inverse of :func:`_group_bnts`: ``[Bm, Km, Gm, Tm', Sm']`` -> ``shape``."""
    Bm, Nm, Tm, Sm = shape
    if not _is_one(Tm):
        x = x[:, :, :, :Tm]
    if not _is_one(Sm):
        x = x[:, :, :, :, :Sm]
    return x.reshape(shape)


def _pad_ids(ids, size):
    """``[B, L]`` ids -> ``[B, size]``, repeating the last id (keeps sorted ids sorted)."""
    L = ids.shape[1]
    if not is_symbolic_dim(L) and not is_symbolic_dim(size) and L == size:
        return ids
    return jnp.take(ids, jnp.minimum(jnp.arange(size), L - 1), axis=1)


def _sides(causal, window):
    """``(left, right)``: key ``j`` of query ``t`` needs ``t - left <= j <= t + right``
    (None: no limit on that side)."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def _pairs(T, S, bq, bk, nq, nk, left, right, always_masked):
    """The block pairs to visit, split into (clean, masked) lists of (i, j) arrays.

    A pair is skipped when the causal mask or the window hides all of it; it is "clean"
    when no mask applies inside it (no user mask or segment ids, entirely inside the
    causal triangle and the window, no padded keys).
    """
    clean, masked = [], []
    for i in range(nq):
        q_lo, q_hi = i * bq, min((i + 1) * bq, T) - 1
        for j in range(nk):
            k_lo, k_hi = j * bk, (j + 1) * bk - 1
            if right is not None and k_lo > q_hi + right:
                continue  # every key right of every query's window (above the diagonal)
            if left is not None and min(k_hi, S - 1) < q_lo - left:
                continue  # every key left of every query's window
            needs = (
                always_masked
                or k_hi >= S
                or (right is not None and k_hi > q_lo + right)
                or (left is not None and k_lo < q_hi - left)
            )
            (masked if needs else clean).append((i, j))

    def arr(ps):
        a = np.asarray(ps, np.int32).reshape(-1, 2)
        return jnp.asarray(a[:, 0]), jnp.asarray(a[:, 1])

    return arr(clean), arr(masked)


# The block products, as einsum specs over [b, k, rows, cols] blocks -> dot_general's
# dimension numbers (batch axes b, k leading, so the result's axes are in spec order).
_BLOCK_PRODUCTS = {
    "bkqh,bksh->bkqs": (((3,), (3,)), ((0, 1), (0, 1))),  # q k^T, do v^T: "NT"
    "bkqs,bksh->bkqh": (((3,), (2,)), ((0, 1), (0, 1))),  # p v, ds k: "NN"
    "bkqs,bkqh->bksh": (((2,), (2,)), ((0, 1), (0, 1))),  # p^T do, ds^T q
}


def _einsum(spec, a, b, *, preferred_element_type):
    """A block product: ``jnp.einsum`` for wide operands; for half-precision ones the
    platform's dot form (:mod:`cannjax._src.core.dots`), which on XLA:CPU keeps
    ``p^T do`` and ``ds^T q`` (contracting the query axis) on the bf16 matrix kernel."""
    if jnp.result_type(a, b).itemsize >= 4:
        return jnp.einsum(spec, a, b, preferred_element_type=preferred_element_type)
    return dots.dot_general(a, b, _BLOCK_PRODUCTS[spec], out_dtype=preferred_element_type)


class _Ctx:
    """Static geometry and block accessors shared by the three rules.

    With a symbolic length (``jax.export``), the block counts are symbolic too and the
    visited pairs cannot be listed while tracing: ``scan_pairs`` then walks every pair
    and skips the hidden ones with ``lax.cond``.
    """

    def __init__(
        self, q, k, res, *, causal, scale, bq, bk, has_mask, has_bias, has_seg, cap, window
    ):
        B, T, N, H, S, K, G, nq, nk = _geometry(q, k, bq, bk)
        self.B, self.T, self.N, self.H, self.S, self.K, self.G = B, T, N, H, S, K, G
        self.bq, self.bk, self.nq, self.nk = bq, bk, nq, nk
        self.Tp, self.Sp = nq * bq, nk * bk
        self.scale, self.cap = scale, cap
        self.has_mask, self.has_bias, self.has_seg = has_mask, has_bias, has_seg
        self.left, self.right = _sides(causal, window)
        # Accumulation dtype: float32 for half precision and float32, float64 for float64.
        self.acc = compute_dtype(q.dtype)
        # Half-precision operands: the kernel's probabilities and output are rounded to
        # q's dtype, and the forward keeps what the backward's D needs (_softmax_finish).
        self.rounded = _rounded(q.dtype)
        # The dtype of every operand the loops read as bits (from_bits): k, v, dO and the
        # tangents all have q's (checked in _check_shapes; the rules' own).
        self.dtype = q.dtype
        self.mask = _group_bnts(res["mask"], K, G, self.Tp, self.Sp) if has_mask else None
        self.bias = _group_bnts(res["bias"], K, G, self.Tp, self.Sp) if has_bias else None
        self.symbolic = is_symbolic_dim(T) or is_symbolic_dim(S)
        # A bias may hold -inf: every pair then needs the -inf-safe exponent base.
        self.safe_all = has_bias
        if has_seg:
            self.q_ids = _pad_ids(res["q_segment_ids"], self.Tp)
            self.kv_ids = _pad_ids(res["kv_segment_ids"], self.Sp)
            self.shared = self._shared_segments()
        if not self.symbolic:
            self.clean, self.masked = _pairs(
                T, S, bq, bk, nq, nk, self.left, self.right, has_mask or has_seg
            )

    def _shared_segments(self):
        """Boolean ``[nq, nk]``: whether query block ``i`` and key block ``j`` may share a
        segment id in some batch row, from the blocks' id ranges ``[min, max]``: exact for
        non-decreasing ids shared by q and kv (packed sequences), conservative otherwise
        (never False where an id is shared)."""
        B = self.B
        qi = self.q_ids.reshape(B, self.nq, self.bq)
        ki = self.kv_ids.reshape(B, self.nk, self.bk)
        q_lo, q_hi = qi.min(-1), qi.max(-1)
        k_lo, k_hi = ki.min(-1), ki.max(-1)
        overlap = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
        return overlap.any(0)

    # q-side arrays are [B, K, G, Tp, X] (or stats [B, K, G, Tp]); kv-side [B, K, Sp, H].
    def kv(self, x):
        """A ``[B, S, K, H]`` key/value-side array grouped: ``[B, K, Sp, H]``, padded."""
        return _group_kv(x, self.Sp)

    def kv_out(self, x, dtype):
        """The inverse of :meth:`kv`: ``[B, S, K, H]`` of ``dtype``."""
        return jnp.transpose(x[:, :, : self.S], (0, 2, 1, 3)).astype(dtype)

    def qrows(self, x, i):
        """Block ``i`` of a q-side array, rows flattened: ``[B, K, G * bq, ...]``."""
        blk = lax.dynamic_slice_in_dim(x, i * self.bq, self.bq, axis=3)
        return self.from_bits(blk.reshape(blk.shape[:2] + (self.G * self.bq,) + blk.shape[4:]))

    def put_qrows(self, x, i, blk):
        blk = blk.reshape(x.shape[:3] + (self.bq,) + x.shape[4:])
        return lax.dynamic_update_slice_in_dim(x, blk.astype(x.dtype), i * self.bq, axis=3)

    def kcols(self, x, j):
        return self.from_bits(lax.dynamic_slice_in_dim(x, j * self.bk, self.bk, axis=2))

    def from_bits(self, blk):
        """A block of an operand read as bits (:mod:`cannjax._src.core.half_bits`), in the
        operands' dtype."""
        return half_bits.from_bits(blk, self.dtype)

    def put_kcols(self, x, j, blk):
        return lax.dynamic_update_slice_in_dim(x, blk.astype(x.dtype), j * self.bk, axis=2)

    # [Bm, Km, Gm, Tm, Sm] arrays (mask, bias and its cotangent): the pair's block, with
    # the broadcast (size-1) dimensions kept at size 1.
    def bnts(self, x, i, j):
        if not _is_one(x.shape[3]):
            x = lax.dynamic_slice_in_dim(x, i * self.bq, self.bq, axis=3)
        if not _is_one(x.shape[4]):
            x = lax.dynamic_slice_in_dim(x, j * self.bk, self.bk, axis=4)
        return x

    def put_bnts(self, x, i, j, blk):
        rows = 0 if _is_one(x.shape[3]) else i * self.bq
        cols = 0 if _is_one(x.shape[4]) else j * self.bk
        starts = [jnp.asarray(n, jnp.int32) for n in (0, 0, 0, rows, cols)]
        return lax.dynamic_update_slice(x, blk.astype(x.dtype), starts)

    def rows(self, blk):
        """A ``[Bm, Km, Gm, bq|1, bk|1]`` block as ``[Bm, Km, G * bq, bk]``."""
        blk = jnp.broadcast_to(blk, blk.shape[:2] + (self.G, self.bq, self.bk))
        return blk.reshape(blk.shape[:2] + (self.G * self.bq, self.bk))

    def to_bias(self, ds):
        """``[B, K, G * bq, bk]`` summed over the bias's broadcast dimensions."""
        ds = ds.reshape(ds.shape[:2] + (self.G, self.bq, self.bk))
        axes = tuple(a for a, d in enumerate(self.bias.shape) if _is_one(d) and ds.shape[a] != 1)
        return ds.sum(axes, keepdims=True) if axes else ds

    def valid(self, i, j):
        """Boolean ``[.., G * bq, bk]`` of the entries of pair ``(i, j)`` to attend."""
        bq, bk = self.bq, self.bk
        rows = i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
        cols = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        ok = jnp.ones((bq, bk), bool)
        if self.right is not None:
            ok = ok & (cols <= rows + self.right)
        if self.left is not None:
            ok = ok & (cols >= rows - self.left)
        if self.symbolic or self.Sp != self.S:
            ok = ok & (cols < self.S)
        ok = ok.reshape(1, 1, 1, bq, bk)
        if self.has_mask:
            ok = ok & self.bnts(self.mask, i, j)
        if self.has_seg:
            qs = lax.dynamic_slice_in_dim(self.q_ids, i * bq, bq, axis=1)
            ks = lax.dynamic_slice_in_dim(self.kv_ids, j * bk, bk, axis=1)
            same = qs[:, :, None] == ks[:, None, :]
            ok = ok & same.reshape(same.shape[0], 1, 1, bq, bk)
        return self.rows(ok)

    def logits(self, qb, kb, i, j, masked):
        """The pair's logits (compute dtype; masked entries ``-inf``) and, with a cap,
        ``tanh(scale q k^T / cap)`` (the cap's derivative is ``(1 - t)(1 + t)``)."""
        # The scale goes on the queries, not on the logits: with ``s = (q k^T) scale``
        # XLA:CPU recomputes the product in each consumer, and LLVM contracts
        # ``s - m`` in the exponent into an FMA on the unrounded product while the row
        # maximum reads the rounded one: ``s - m > 0`` by up to half an ulp of ``s``
        # (hundreds for logits near 1e9), and the exponent overflows or underflows the
        # row. A dot's output is read rounded by every consumer.
        qs = (qb.astype(self.acc) * self.scale).astype(qb.dtype)
        s = _einsum("bkqh,bksh->bkqs", qs, kb, preferred_element_type=self.acc)
        t = None
        if self.cap is not None:
            t = jnp.tanh(s / self.cap)
            s = self.cap * t
        if self.has_bias:
            s = s + self.rows(self.bnts(self.bias, i, j)).astype(self.acc)
        if masked:
            s = jnp.where(self.valid(i, j), s, -jnp.inf)
        return s, t

    def cap_grad(self, ds, t):
        """``ds`` (with respect to the capped logits) taken back through the cap."""
        return ds if t is None else ds * ((1 - t) * (1 + t))

    def visible(self, i, j):
        """Traced: whether pair ``(i, j)`` is visible through causal and window (the
        symbolic path, where the pairs are not listed); None when nothing hides pairs."""
        out = None
        if self.right is not None:
            q_hi = jnp.minimum((i + 1) * self.bq, self.T) - 1
            out = j * self.bk <= q_hi + self.right
        if self.left is not None:
            k_top = jnp.minimum((j + 1) * self.bk, self.S) - 1
            seen = k_top >= i * self.bq - self.left
            out = seen if out is None else out & seen
        return out

    def scan_pairs(self, body, carry, live=None, one_loop=False):
        """Runs ``carry = body(carry, i, j, masked, live)`` over every visited pair;
        ``live`` is None (always) or a traced bool: the pair may hold an entry to attend
        (its segment ids may meet; under symbolic shapes also: visible). A ``live``
        given here (a traced bool) holds for every pair: False skips them all (ring
        attention's blocks in the future of a causal query block). ``one_loop``: the
        clean pairs run with the masked ones, as masked, when a group holds one pair."""
        if self.symbolic:
            return self._scan_symbolic(body, carry, live)
        every = live
        groups = ((self.clean, False), (self.masked, True))
        if one_loop and min(self.clean[0].shape[0], self.masked[0].shape[0]) == 1:
            # A loop of one pair is no loop to XLA: see _grad_pairs.
            both = tuple(jnp.concatenate(ij) for ij in zip(self.clean, self.masked))
            groups = ((both, True),)
        for (ii, jj), masked in groups:
            if ii.shape[0] == 0:
                continue

            def step(c, ij, masked=masked):
                i, j = ij[0], ij[1]
                live = _both(every, self.shared[i, j] if self.has_seg else None)
                return body(c, i, j, masked, live), None

            carry, _ = lax.scan(step, carry, (ii, jj))
        return carry

    def _scan_symbolic(self, body, carry, every=None):
        # nq * nk pairs in row-major order, each masked (padded keys, causal diagonal,
        # window and user mask alike); a pair hidden by causal or the window is skipped
        # by lax.cond, as the static path skips it when listing the pairs. A scan (not a
        # while loop) with a symbolic trip count, so that it transposes like the static one.
        nq, nk = self.nq, self.nk

        def step(c, p):
            i, j = p // nk, p % nk
            live = _both(every, self.visible(i, j))
            if self.has_seg:
                live = _both(live, self.shared[i, j])
            return body(c, i, j, True, live), None

        carry, _ = lax.scan(step, carry, jnp.arange(nq * nk, dtype=jnp.int32))
        return carry

    @staticmethod
    def when(live, fn, old):
        """``fn(old)`` where the pair is live, ``old`` unchanged where it is skipped.

        Only the pair's blocks go through ``lax.cond`` (not the whole accumulators), so a
        skipped pair costs a few block-sized copies. Under ``vmap`` with batched segment
        ids the cond becomes a select: both branches run, nothing is skipped.
        """
        if live is None:
            return fn(old)
        return lax.cond(live, fn, lambda o: o, old)


def _both(a, b):
    """The conjunction of two optional traced bools (None: always true)."""
    return b if a is None else a if b is None else a & b


# ------------------------------------------------------------------------------ attention
def _inputs(res, has_seg, has_bias):
    """The kernels' operands from the residuals ``res`` and their axes
    (:class:`HeadsLayout`): ``q, k, v`` with heads and features merged (``[B, T, N H]``:
    a projection's output split over its features is split over one axis there, where
    ``[B, T, N, H]`` may split part of an axis over ``N`` and the rest over ``H``), the
    mask always (one element when None), the segment ids one element each when not
    given, the bias only when given; broadcast axes are ``1``."""
    q, k = res["q"], res["k"]
    B, T, N, H = q.shape
    S = k.shape[1]
    if has_seg:
        ids = [res["q_segment_ids"], res["kv_segment_ids"]]
        id_axes = ("bt", "bs")
    else:
        ids = [jnp.zeros((1, 1), jnp.int32)] * 2
        id_axes = ("11", "11")

    def axes(x):  # of an array broadcastable to [B, N, T, S]
        return "".join(c if d == n else "1" for c, d, n in zip("bnts", x.shape, (B, N, T, S)))

    args = [_merged(q), _merged(k), _merged(res["v"]), res["mask"], *ids]
    letters = ("btq", "bsk", "bsk", axes(res["mask"])) + id_axes
    if has_bias:
        args.append(res["bias"])
        letters += (axes(res["bias"]),)
    return args, letters


def _head_counts(q, k):
    return {"heads": k.shape[2], "query_heads": q.shape[2], "head_dim": q.shape[3]}


def _merged(x):
    """``[B, T, N, H]`` as ``[B, T, N H]``."""
    return x.reshape(*x.shape[:2], -1)


def _split_heads(x, H):
    """``[B, T, N H]`` as ``[B, T, N, H]``."""
    return x.reshape(*x.shape[:2], -1, H)


def _forward(q, k, v, mask, q_ids, kv_ids, bias=None, **static):
    # The bias and segment ids are kept only when given (the mask always, one element
    # when None, as before they existed).
    res = {"q": q, "k": k, "v": v, "mask": mask}
    if static["has_bias"]:
        res["bias"] = bias
    if static["has_seg"]:
        res["q_segment_ids"], res["kv_segment_ids"] = q_ids, kv_ids
    # Each device runs the kernel on its own batch rows and heads, whatever sharding the
    # program gives q, k, v (core/partitioned.HeadsLayout).
    args, letters = _inputs(res, static["has_seg"], static["has_bias"])
    # Half precision keeps round(O - mean_j v) besides the output (_softmax_finish).
    rounded = _rounded(q.dtype)
    outs = ("btq", "bnt") + (("btq",) if rounded else ())
    layout = HeadsLayout(ins=letters, outs=outs, **_head_counts(q, k))
    got = row_local(bound(_forward_local, H=q.shape[3], **static), layout, *args)
    out, lse = _split_heads(got[0], q.shape[3]), got[1]
    kept = _split_heads(got[2], q.shape[3]) if rounded else out
    return out, {**res, "out": kept, "lse": lse}


def _forward_local(q, k, v, mask, q_ids, kv_ids, bias=None, *, shards, H, **static):
    """``[out, lse]`` of the blockwise kernel on one device's batch rows and heads, and
    in half precision what the backward keeps for ``D`` (:func:`_softmax_finish`)."""
    q, k, v = (_split_heads(x, H) for x in (q, k, v))
    res = {"mask": mask, "bias": bias, "q_segment_ids": q_ids, "kv_segment_ids": kv_ids}
    c = _Ctx(q, k, res, **static)
    qg, kg, vg = (half_bits.as_bits(x) for x in (_group_q(q, c.K, c.G, c.Tp), c.kv(k), c.kv(v)))
    # Inside shard_map the carries vary as the inputs do (cannjax/_src/core/vma.py).
    carry = varying_like(_softmax_init(c), q, k, v, mask, q_ids, kv_ids, bias)
    v_mean = _values_mean(v, c.acc) if c.rounded else None
    out, lse, kept = _softmax_finish(c, _softmax_pairs(c, qg, kg, vg, carry), q.dtype, v_mean)
    return [_merged(out), lse] + ([_merged(kept)] if c.rounded else [])


def _softmax_init(c):
    """The online softmax's empty state ``(m, l, acc)``: ``m = -inf``, ``l = acc = 0``;
    with rounded probabilities (half precision) also ``l~ = 0`` (:func:`_softmax_pairs`)."""
    stat = (c.B, c.K, c.G, c.Tp)
    m0 = jnp.full(stat, -jnp.inf, c.acc)
    state = (m0, jnp.zeros(stat, c.acc), jnp.zeros(stat + (c.H,), c.acc))
    return state + (jnp.zeros(stat, c.acc),) if c.rounded else state


def _softmax_pairs(c, qg, kg, vg, carry, live=None):
    """The online softmax over ``c``'s visited pairs, from the state ``carry``: for
    each pair, with ``m`` the running row maximum,

      m' = max(m, max_j s),  l' = e^(m - m') l + sum_j e^(s - m'),
      acc' = e^(m - m') acc + sum_j e^(s - m') v.

    A row with nothing to attend so far has ``m = -inf``; its exponent base is taken as
    0 so that masked entries (``s = -inf``) give ``e^(-inf) = 0``, never ``-inf - (-inf)
    = NaN``. The kernel's layouts (``_group_q``, :meth:`_Ctx.kv`) throughout.

    In half precision ``acc`` takes the probabilities rounded, ``p~ = round(e^(s -
    m'))`` (the fast bfloat16 product), and the state has a fourth member, ``l~``, their
    sum: the output ``acc / l~`` is then a weighted mean of the values whose weights sum
    to 1 exactly, so a mean shared by all values passes through it with no error (over
    ``l`` its error is ``mean * sum_j (p~ - p) / l``), and the backward's ``D`` can be
    formed to match its float32 ``p`` (:func:`_softmax_finish`)."""

    def body(carry, i, j, masked, live):
        def update(old):
            m_old, l_old, acc_old = old[:3]
            qb, kb, vb = c.qrows(qg, i), c.kcols(kg, j), c.kcols(vg, j)
            s, _ = c.logits(qb, kb, i, j, masked)
            m_new = jnp.maximum(m_old, s.max(-1))
            safe = masked or c.safe_all
            base = jnp.where(m_new == -jnp.inf, 0.0, m_new) if safe else m_new
            p = jnp.exp(s - base[..., None])
            alpha = jnp.exp(m_old - base)
            l_new = alpha * l_old + p.sum(-1)
            pr = p.astype(vb.dtype)
            pv = _einsum("bkqs,bksh->bkqh", pr, vb, preferred_element_type=c.acc)
            new = (m_new, l_new, alpha[..., None] * acc_old + pv)
            if c.rounded:
                new += (alpha * old[3] + pr.astype(c.acc).sum(-1),)
            return new

        old = tuple(c.qrows(x, i) for x in carry)
        new = c.when(live, update, old)
        return tuple(c.put_qrows(x, i, y) for x, y in zip(carry, new))

    return c.scan_pairs(body, carry, live)


def _softmax_finish(c, carry, dtype, v_mean=None):
    """``(out [B, T, N, H] of dtype, lse [B, N, T], kept)`` from the online softmax's
    state; ``kept`` is what the backward keeps for ``D = rowsum(dO * O)``.

    Rows with nothing to attend (``l = 0``): output 0 and ``lse = 0``. Every logit of
    such a row is -inf (masked), so the backward's ``e^(s - lse)`` is 0 there without a
    branch; a finite lse keeps the residual free of inf where the result has none
    (jax.debug_infs checks it).

    In float32 and float64 ``kept`` is ``out``. In half precision the output is rounded,
    and ``D`` from it errs by ``dO . (round(O) - O)``, up to an ulp of ``O``'s size: where
    the values share a large mean ``c`` (a common direction of the residual stream, as
    trained transformers' values and keys have), that is large beside ``dP - D``, which
    ``c`` cancels from, and every ``dS = P (dP - D)`` row sums to ``-error`` instead of 0,
    which the keys' mean multiplies in ``dQ``. So ``kept = round(O - c)`` with ``c =
    v_mean`` (``[B, K, H]``, the values' mean over the keys, which the backward recomputes
    from ``v``): it errs by an ulp of ``O - c`` only."""
    m, den, acc = carry[:3]
    seen = den > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, den, 1.0)), 0.0)
    if c.rounded:  # the weights of acc are the rounded p~ (_softmax_pairs)
        seen = carry[3] > 0
        den = carry[3]
    exact = jnp.where(seen[..., None], acc / jnp.where(seen, den, 1.0)[..., None], 0.0)
    out = _ungroup_q(exact, c.T).astype(dtype)
    kept = out
    if c.rounded:
        kept = _ungroup_q(exact - v_mean[:, :, None, None, :], c.T).astype(dtype)
    return out, lse[:, :, :, : c.T].reshape(c.B, c.N, c.T), kept


def _values_mean(v, acc):
    """The values' mean over the keys, ``[B, K, H]`` of ``acc`` (``v [B, S, K, H]``)."""
    return jnp.mean(v.astype(acc), axis=1)


def _prepare(res, c):
    """The grouped operands as the loops read them (half precision as bits:
    :mod:`cannjax._src.core.half_bits`) and the lse."""
    qg, lse = _prepare_q(c, res["q"], res["lse"])
    kg, vg = c.kv(res["k"]), c.kv(res["v"])
    return tuple(half_bits.as_bits(x) for x in (qg, kg, vg)) + (lse,)


def _prepare_q(c, q, lse):
    """The queries and the saved ``lse`` grouped: ``[B, K, G, Tp, H]``, ``[B, K, G, Tp]``
    (padded rows get ``lse = inf``: probability 0)."""
    lse = lse.reshape(c.B, c.K, c.G, c.T)
    lse = jnp.pad(lse, [(0, 0)] * 3 + [(0, c.Tp - c.T)], constant_values=jnp.inf)
    return _group_q(q, c.K, c.G, c.Tp), lse


def _probs(c, s, lse_b):
    # p = e^(s - lse): exact softmax probabilities given the saved per-row lse.
    return jnp.exp(s - lse_b[..., None])


def _backward(res, g, **static):
    args, letters = _inputs(res, static["has_seg"], static["has_bias"])
    layout = HeadsLayout(ins=letters + ("btq", "bnt", "btq"), outs=letters[:3] + letters[6:],
                         **_head_counts(res["q"], res["k"]))  # fmt: skip
    H = res["q"].shape[3]
    # Whether the bias is broadcast over the batch and over the heads (read off its
    # global shape: a device's slice of one head or row has a dimension of 1 too).
    spread = tuple(c == "1" for c in letters[6][:2]) if static["has_bias"] else (False, False)
    local = bound(_backward_local, H=H, spread=spread, **static)
    grads = row_local(local, layout,
                      *args, _merged(res["out"]), res["lse"], _merged(g))  # fmt: skip
    return tuple(_split_heads(x, H) for x in grads[:3]) + tuple(grads[3:])


def _backward_local(q, k, v, mask, q_ids, kv_ids, *rest, shards, H, spread, **static):
    """``[dq, dk, dv(, dbias)]`` on one device's batch rows and heads (``q, k, v, dq,
    dk, dv`` as ``[B, T, N H]``); a bias broadcast over a split axis has its gradient
    summed over the devices along it."""
    bias, (out, lse, g) = (rest[0] if static["has_bias"] else None), rest[-3:]
    q, k, v, out, g = (_split_heads(x, H) for x in (q, k, v, out, g))
    res = {"q": q, "k": k, "v": v, "mask": mask, "bias": bias, "q_segment_ids": q_ids,
           "kv_segment_ids": kv_ids, "out": out, "lse": lse}  # fmt: skip
    c = _Ctx(q, k, res, **static)
    qg, kg, vg, lse = _prepare(res, c)
    v_mean = _values_mean(v, c.acc) if c.rounded else None
    dog, d = _grad_rows(c, g, res["out"], v_mean)
    zq = zeros_after(d).astype(c.acc)  # [B, K, G, Tp]
    zk = zq.max((2, 3))[:, :, None, None]  # [B, K, 1, 1]
    carry = [jnp.broadcast_to(zq[..., None], qg.shape), jnp.broadcast_to(zk, kg.shape)]
    carry.append(jnp.broadcast_to(zk, vg.shape))
    if c.has_bias:
        # Unused when the bias is not differentiated: XLA then drops this accumulator
        # (tests/test_attention_llm.py checks the compiled temp memory).
        carry.append(jnp.zeros(c.bias.shape, c.acc))
    carry = _grad_pairs(c, qg, kg, vg, lse, dog, d, varying_like(carry, res, g))
    dq = _ungroup_q(carry[0], c.T).astype(q.dtype)
    dk, dv = c.kv_out(carry[1], k.dtype), c.kv_out(carry[2], v.dtype)
    if c.has_bias:  # the bias is the operator's 7th argument only when given
        dbias = _ungroup_bnts(carry[3], bias.shape)
        if spread[0]:
            dbias = shards.rows_sum(dbias)
        if spread[1]:
            dbias = shards.heads_sum(dbias)
        return [_merged(dq), _merged(dk), _merged(dv), dbias.astype(bias.dtype)]
    return [_merged(dq), _merged(dk), _merged(dv)]


def zeros_after(x):
    """Zeros of ``x``'s shape computed from ``x`` elementwise (``|0 * x|``, ``x`` made
    finite), for a backward's accumulators: built from a value of the backward, they
    cannot exist before it does. Plain zeros are constants to XLA:CPU, which drops
    optimization barriers and schedules for concurrency: it made them at the top of the
    program and held them through the forward (attention's gradient at T=8192 held
    96.8 MiB of temp with them, 67.0 MiB without; benchmarks/attention.py). Elementwise,
    so that a sharded ``x`` needs no collective (reading one element of it would)."""
    return jnp.abs(jnp.where(jnp.isfinite(x), x, 0) * 0)


def _grad_rows(c, g, kept, v_mean=None):
    """The output cotangent grouped, ``dO [B, K, G, Tp, H]``, and ``D = rowsum(dO * O)``
    ``[B, K, G, Tp]`` in the compute dtype, from what the forward kept of ``O``: ``O``
    itself, or in half precision ``round(O - v_mean)`` (:func:`_softmax_finish`), where
    ``D = rowsum(dO * (O - v_mean)) + dO . v_mean``."""
    dog = _group_q(g, c.K, c.G, c.Tp)
    out = _group_q(kept, c.K, c.G, c.Tp).astype(c.acc)
    if c.rounded:
        out = out + v_mean[:, :, None, None, :]
    return half_bits.as_bits(dog), jnp.sum(dog.astype(c.acc) * out, -1)


def _grad_pairs(c, qg, kg, vg, lse, dog, d, carry, live=None):
    """Adds each visited pair's ``dQ, dK, dV`` (and ``dbias``) to the accumulators
    ``carry`` (grouped layouts, compute dtype).

    FlashAttention-2: with ``P = softmax(S)``, ``O = P V`` and ``dO`` given,

      dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D),  D = rowsum(dO * O) = rowsum(P * dP),

    and ``S = cap tanh(scale Q K^T / cap) + bias`` (``S = scale Q K^T + bias`` without a
    cap): ``dbias = dS`` (summed over its broadcast dimensions), ``dQ = scale dR K``,
    ``dK = scale dR^T Q``, ``dR = dS * (1 - tanh^2)`` (``dR = dS`` uncapped). ``D`` comes
    from ``O`` (:func:`_grad_rows`), so each pair needs only its own block of ``P``, and
    ``P`` from the saved ``lse`` alone: any split of the keys into parts whose ``dQ``
    are summed gives the same result (ring attention's blocks)."""

    def body(carry, i, j, masked, live):
        def update(old):
            qb, kb, vb = c.qrows(qg, i), c.kcols(kg, j), c.kcols(vg, j)
            dob = c.qrows(dog, i)
            s, t = c.logits(qb, kb, i, j, masked)
            p = _probs(c, s, c.qrows(lse, i))
            dvb = _einsum("bkqs,bkqh->bksh", p.astype(dob.dtype), dob, preferred_element_type=c.acc)
            dp = _einsum("bkqh,bksh->bkqs", dob, vb, preferred_element_type=c.acc)
            ds = p * (dp - c.qrows(d, i)[..., None])
            dr = c.cap_grad(ds, t) * c.scale
            dqb = _einsum("bkqs,bksh->bkqh", dr.astype(kb.dtype), kb, preferred_element_type=c.acc)
            dkb = _einsum("bkqs,bkqh->bksh", dr.astype(qb.dtype), qb, preferred_element_type=c.acc)
            new = [old[0] + dqb, old[1] + dkb, old[2] + dvb]
            if c.has_bias:
                new.append(old[3] + c.to_bias(ds))
            return new

        old = [c.qrows(carry[0], i), c.kcols(carry[1], j), c.kcols(carry[2], j)]
        if c.has_bias:
            old.append(c.bnts(carry[3], i, j))
        new = c.when(live, update, old)
        out = [c.put_qrows(carry[0], i, new[0]), c.put_kcols(carry[1], j, new[1])]
        out.append(c.put_kcols(carry[2], j, new[2]))
        if c.has_bias:
            out.append(c.put_bnts(carry[3], i, j, new[3]))
        return out

    # A group of one pair is a loop of one iteration, which XLA inlines: its blocks of
    # Q, K, V and its P = e^(S - lse) are then values of the forward's operands alone,
    # which XLA:CPU computes in the forward and holds until the backward (at T=256 with
    # blocks of 128, the one clean pair held four blocks per layer of an unrolled
    # flax.nnx GPT). Run with the masked pairs, every pair reads the loop's index.
    return c.scan_pairs(body, list(carry), live, one_loop=True)


def _tangent(res, tq, tk, tv, tb=None, **static):
    q, k = res["q"], res["k"]
    c = _Ctx(q, k, res, **static)
    qg, kg, vg, lse = _prepare(res, c)
    tqg = half_bits.as_bits(_group_q(tq, c.K, c.G, c.Tp))
    tkg, tvg = half_bits.as_bits(c.kv(tk)), half_bits.as_bits(c.kv(tv))
    tbg = _group_bnts(tb, c.K, c.G, c.Tp, c.Sp) if c.has_bias else None
    carry = varying_like(_tangent_init(c), res, tq, tk, tv, tb)
    carry = _tangent_pairs(c, qg, kg, vg, lse, tqg, tkg, tvg, tbg, carry)
    v_mean = _values_mean(res["v"], c.acc) if c.rounded else None
    return _tangent_finish(c, carry, res["out"], tq.dtype, v_mean)


def _tangent_init(c):
    stat = (c.B, c.K, c.G, c.Tp)
    init = (jnp.zeros(stat + (c.H,), c.acc), jnp.zeros(stat, c.acc))
    return init + (jnp.zeros(stat, c.acc),) if c.rounded else init


def _tangent_pairs(c, qg, kg, vg, lse, tqg, tkg, tvg, tbg, carry, live=None):
    """Adds each visited pair's part of the output tangent to ``carry = (a, r)``.

    With ``dS = cap'(R) scale (dQ K^T + Q dK^T) + dbias`` (``cap'(R) = 1 - tanh^2``, or 1
    uncapped) and ``P = softmax(S)``:

      dP = P * (dS - r),  r = rowsum(P * dS),
      dO = P dV + dP V = a - r O,  a = P dV + (P * dS) V,

    both sums over the keys, pair by pair from the saved ``lse`` (linear in dQ, dK, dV,
    dbias); :func:`_tangent_finish` forms ``a - r O``. In half precision the carry has a
    third sum, ``r~ = rowsum(round(P * dS))``, of what ``a`` took rounded."""

    def body(carry, i, j, masked, live):
        def update(old):
            qb, kb, vb = c.qrows(qg, i), c.kcols(kg, j), c.kcols(vg, j)
            tqb, tkb, tvb = c.qrows(tqg, i), c.kcols(tkg, j), c.kcols(tvg, j)
            s, t = c.logits(qb, kb, i, j, masked)
            p = _probs(c, s, c.qrows(lse, i))
            ds = _einsum("bkqh,bksh->bkqs", tqb, kb, preferred_element_type=c.acc)
            ds = ds + _einsum("bkqh,bksh->bkqs", qb, tkb, preferred_element_type=c.acc)
            ds = c.cap_grad(ds * c.scale, t)
            if c.has_bias:
                ds = ds + c.rows(c.bnts(tbg, i, j)).astype(c.acc)
            pds = p * ds
            pdr = pds.astype(vb.dtype)
            a = _einsum("bkqs,bksh->bkqh", p.astype(tvb.dtype), tvb, preferred_element_type=c.acc)
            a = a + _einsum("bkqs,bksh->bkqh", pdr, vb, preferred_element_type=c.acc)
            new = (old[0] + a, old[1] + pds.sum(-1))
            if c.rounded:
                new += (old[2] + pdr.astype(c.acc).sum(-1),)
            return new

        new = c.when(live, update, tuple(c.qrows(x, i) for x in carry))
        return tuple(c.put_qrows(x, i, y) for x, y in zip(carry, new))

    return c.scan_pairs(body, tuple(carry), live)


def _tangent_finish(c, carry, kept, dtype, v_mean=None):
    """``dO = a - r O`` as ``[B, T, N, H]`` of ``dtype``, from what the forward kept of
    ``O`` (:func:`_softmax_finish`). In half precision, with ``kept = round(O - v_mean)``:
    ``dO = (a - r~ v_mean) - r kept``, where ``a - r~ v_mean`` is the product with the
    values less their mean, which ``r`` cancels (the mean times the rounding of ``P *
    dS`` is no longer in it)."""
    acc, rs = carry[:2]
    out = _group_q(kept, c.K, c.G, c.Tp).astype(c.acc)
    if c.rounded:
        acc = acc - carry[2][..., None] * v_mean[:, :, None, None, :]
    return _ungroup_q(acc - rs[..., None] * out, c.T).astype(dtype)


# The rules are jitted so that eager calls (and the many small calls of check_op) reuse
# compiled scans instead of retracing them; under an outer trace jit is simply inlined.
_STATIC = ("causal", "scale", "bq", "bk", "has_mask", "has_bias", "has_seg", "cap", "window")
_attention = defop(
    "attention",
    forward=jax.jit(_forward, static_argnames=_STATIC),
    tangent=jax.jit(_tangent, static_argnames=_STATIC),
    backward=jax.jit(_backward, static_argnames=_STATIC),
    nondiff_argnums=(3, 4, 5),
    residuals={
        "q": "the queries [B, T, N, H] (an input)",
        "k": "the keys [B, S, K, H] (an input)",
        "v": "the values [B, S, K, H] (an input)",
        "mask": "the boolean mask as given, rank 4 (one element when None; an input)",
        "bias": "the additive bias as given, rank 4 (only when given; an input)",
        "q_segment_ids": "the query segment ids [B, T] (only when given; an input)",
        "kv_segment_ids": "the key segment ids [B, S] (only when given; an input)",
        "out": "the output [B, T, N, H]; half precision: round(output - the values' mean "
        "over the keys), for the backward's D (_softmax_finish)",
        "lse": "per-row logsumexp of the logits [B, N, T], float32 (0: no key)",
    },
    level=Level.DERIVED,
    reuse=(),
)


def _reference(
    q,
    k,
    v,
    *,
    causal=False,
    mask=None,
    bias=None,
    scale=None,
    logit_cap=None,
    window=None,
    segment_ids=None,
    block_q=None,
    block_k=None,
):
    """Plain-jnp attention, as ``jax.nn.dot_product_attention`` computes it, with the
    soft cap and segment ids written out.

    Differences: computed in the inputs' precision (jax's softmax is always float32,
    which would make a float64 reference float32-accurate), and query rows with no key
    to attend (masks, window, segments, or a ``-inf`` bias everywhere) give 0 (jax's
    give the mean of ``v``). tests/test_attention.py and tests/test_attention_llm.py
    check it against ``jax.nn.dot_product_attention`` itself.
    """
    del block_q, block_k
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    qg = q.reshape(B, T, K, G, H)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k) * scale
    if logit_cap is not None:
        s = logit_cap * jnp.tanh(s / logit_cap)
    attend = jnp.ones((1, 1, T, S), bool)
    if bias is not None:
        bias = jnp.asarray(bias)
        bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
        b5 = jnp.broadcast_to(bias, (B, N, T, S)).reshape(B, K, G, T, S)
        s = s + b5.astype(s.dtype)
        attend = attend & (bias > -jnp.inf)  # a -inf bias masks its entry
    if mask is not None:
        mask = jnp.asarray(mask)
        attend = attend & mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    rows, cols = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
    if causal:
        attend = attend & (cols <= rows)[None, None]
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        attend = attend & ((cols >= rows - left) & (cols <= rows + right))[None, None]
    if segment_ids is not None:
        qs, ks = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids,) * 2
        attend = attend & (jnp.asarray(qs)[:, :, None] == jnp.asarray(ks)[:, None, :])[:, None]
    attend = jnp.broadcast_to(attend, (B, N, T, S)).reshape(B, K, G, T, S)
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
    # Every new argument at once, with 2 x 3 blocks: packed sequences (non-decreasing
    # ids; the pair (query block 0, key block 1) shares no id and is skipped at run
    # time), a bias with -inf entries (heads 1 and 2 lose keys 5 and 6; query 2 loses
    # every key), a cap and a two-sided window. Queries 2 and 4 (whose id 3 meets no
    # key) attend nothing: output 0, gradient 0.
    seg = (jnp.array([[0, 0, 1, 1, 3]]), jnp.array([[0, 0, 0, 1, 1, 1, 2]]))
    bias = jax.random.normal(jax.random.key(8), (1, 4, 5, 7)) * 0.5
    bias = bias.at[:, :, 2].set(-jnp.inf).at[:, 1:3, :, 5:].set(-jnp.inf)
    # The cases below name every config keyword, so `cannjax ops` runs each once.
    pinned = {"causal": False, "window": None, "logit_cap": None, "block_q": 2, "block_k": 3}
    return [
        EdgeCase((q, k, v), kwargs={"mask": mask, "block_q": 2, "block_k": 3}),
        EdgeCase((q, k, v), kwargs={"mask": jnp.zeros((5, 7), bool)}),
        # Gradients here agree to ~eps * |s| (|s| ~ 40): an absolute 1e-5, not 1e-6.
        EdgeCase((big, k, v), kwargs={"causal": True, "block_q": 2, "block_k": 2}, atol=1e-5),
        EdgeCase(
            (q, k, v),
            kwargs={**pinned, "segment_ids": seg, "bias": bias, "logit_cap": 2.0, "window": (3, 1)},
        ),
        # Logits ~1e3 under a cap of 5: tanh saturates, its derivative underflows to 0.
        EdgeCase(
            (q * 30.0, k * 30.0, v),
            kwargs={**pinned, "logit_cap": 5.0, "causal": True, "block_k": 2},
        ),
    ]


# The operator's arguments 3-5 are the mask and segment ids, the 6th (only when given)
# the bias; the public function takes them by keyword, so all of its positional
# arguments (q, k, v) are differentiated (the bias's gradient is tested in
# tests/test_attention_llm.py).
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
        {"causal": True, "window": (2, 0), "logit_cap": 3.0, "block_q": 2, "block_k": 2},
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
    bias: ArrayLike | None = None,
    scale: float | None = None,
    logit_cap: float | None = None,
    window: int | tuple[int, int] | None = None,
    segment_ids: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> jax.Array:
    """Scaled dot-product attention that never materializes the ``T x S`` matrix.

    Same math as ``jax.nn.dot_product_attention(q, k, v, bias, mask, is_causal=causal,
    scale=scale, local_window_size=window)``, with a logit soft cap and segment ids::

      r[b, n, t, j] = scale * sum_h q[b, t, n, h] k[b, j, n // G, h]   (G = N // K)
      s = logit_cap * tanh(r / logit_cap) + bias[b, n, t, j]    (s = r + bias uncapped)
      p = softmax_j(s)  over the keys j that t may attend
      out[b, t, n, h] = sum_j p[b, n, t, j] v[b, j, n // G, h]

    Query ``t`` may attend key ``j`` when ``mask[b, n, t, j]`` (if given), ``j <= t`` (if
    causal), ``t - left <= j <= t + right`` (if ``window = (left, right)``), the two
    tokens' segment ids are equal (if given), and ``bias[b, n, t, j] > -inf``. A query
    row with no key to attend gives output 0 and gradient 0 (jax's gives the mean of
    ``v`` there).

    The forward keeps ``q, k, v``, the bias, mask and segment ids as given, the output
    (for half-precision inputs, the output less the values' mean over the keys, which the
    backward's ``rowsum(dO * O)`` needs to be accurate: docs/attention.md) and the per-row
    logsumexp (``B N T`` floats); the backward recomputes ``p`` block by block
    (FlashAttention-2), through the cap's derivative ``1 - tanh^2``. Memory beyond
    inputs and outputs is ``O(block_q * block_k)`` per head instead of ``O(T * S)``.
    Block pairs hidden by ``causal`` or the window are never visited; pairs whose query
    and key blocks share no segment id are skipped at run time (``lax.cond``; under
    ``vmap`` with batched segment ids it becomes a select and nothing is skipped).

    Args:
      q: queries ``[B, T, N, H]``, floating point.
      k: keys ``[B, S, K, H]``, same dtype as ``q``; ``K`` divides ``N`` (grouped-query
        attention: query head ``n`` reads key/value head ``n // (N // K)``).
      v: values ``[B, S, K, H]``, same dtype as ``q``.
      causal: query ``t`` attends only keys ``j <= t`` (top-left aligned, as jax's).
      mask: optional boolean array broadcastable to ``[B, N, T, S]``; True = attend.
        Not differentiated.
      bias: optional floating-point array broadcastable to ``[B, N, T, S]``, added to the
        (capped) logits in the compute dtype (float32 for half-precision ``q``);
        differentiated: its gradient is the gradient with respect to the logits ``s``,
        summed over its broadcast dimensions. ``-inf`` entries mask. When it is not
        differentiated (an ALiBi bias, say) the gradient's accumulator is dead code that
        XLA removes.
      scale: multiplies the logits; ``1 / sqrt(H)`` when None.
      logit_cap: soft-capping of the scaled logits, ``cap * tanh(r / cap)``, before the
        bias and the masks (Gemma 2 uses 50.0); a static float > 0, or None.
      window: sliding window: an int ``w`` (``(w, w)``) or a pair ``(left, right)`` of
        ints >= 0; query ``t`` attends keys ``t - left <= j <= t + right``, as
        ``local_window_size`` of ``jax.nn.dot_product_attention``. With ``causal``,
        ``(w, 0)`` is a causal sliding window of ``w + 1`` keys (Mistral).
      segment_ids: packed sequences: an integer ``[B, T]`` array shared by queries and
        keys (needs ``T == S``), or a pair ``(q_segment_ids [B, T], kv_segment_ids [B,
        S])``; query ``t`` attends key ``j`` only when their ids are equal. The skipping
        test compares each block's id range ``[min, max]``: exact for non-decreasing ids
        shared by queries and keys (packed sequences), conservative otherwise (a pair is
        visited when it may share an id; masking stays exact).
      block_q: query rows per block; :func:`attention_block_sizes` when None. At most
        ``T``, except under ``jax.export`` with a symbolic ``T``, where the queries are
        padded to a whole number of blocks instead.
      block_k: key columns per block; :func:`attention_block_sizes` when None. Likewise
        at most ``S``, unless ``S`` is symbolic.

    Returns:
      ``[B, T, N, H]`` array of ``q``'s dtype. Empty inputs (any of ``B, T, N, S, H``
      zero) give zeros of that shape, as ``jax.nn.dot_product_attention`` does (``S = 0``
      leaves every query row nothing to attend).

    Raises:
      TypeError: non-floating or mismatched dtypes of ``q, k, v``, a non-boolean mask, a
        non-floating bias, non-integer segment ids, a non-float ``logit_cap``, a window
        that is not an int or a pair of ints, or a non-int block size.
      ValueError: inputs not of rank 4, mismatched batch, length or head dimensions,
        ``K`` not dividing ``N``, a mask or bias that does not broadcast to
        ``[B, N, T, S]``, segment ids not of shape ``[B, T]`` / ``[B, S]`` (or shared ids
        with ``T != S``), a negative window side, ``logit_cap <= 0``, a block size < 1,
        or ``scale=None`` with a symbolic head dimension ``H`` (under ``jax.export``;
        symbolic ``B``, ``T`` and ``S`` are supported, docs/export.md).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from cannjax.ops import attention
      >>> q = k = v = jnp.ones((1, 4, 2, 8))
      >>> attention(q, k, v, causal=True).shape
      (1, 4, 2, 8)
      >>> g = jax.grad(lambda q: attention(q, k, v, causal=True).sum())(q)
      >>> bool(jnp.isfinite(g).all())
      True
      >>> ids = jnp.array([[0, 0, 1, 1]])  # two packed sequences of 2 tokens
      >>> out = attention(q, k, v, causal=True, window=(1, 0), logit_cap=30.0,
      ...                 segment_ids=ids)
      >>> out.shape
      (1, 4, 2, 8)

    References:
      Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
      Partitioning", 2023. https://arxiv.org/abs/2307.08691
      Rabe and Staats, "Self-attention Does Not Need O(n^2) Memory", 2021.
      https://arxiv.org/abs/2112.05682
      Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models from
      Multi-Head Checkpoints", 2023. https://arxiv.org/abs/2305.13245
      Gemma Team, "Gemma 2: Improving Open Language Models at a Practical Size", 2024
      (logit soft-capping). https://arxiv.org/abs/2408.00118
      Beltagy et al., "Longformer: The Long-Document Transformer", 2020 (sliding
      windows). https://arxiv.org/abs/2004.05150
      Jiang et al., "Mistral 7B", 2023 (causal sliding window).
      https://arxiv.org/abs/2310.06825
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
        scale = 1.0 / math.sqrt(H) if H else 1.0  # H = 0: an empty result, any scale
    elif isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.floating)):
        raise TypeError(f"{_FN}: scale must be a Python float (static), got {scale!r}")
    cap = _as_cap(logit_cap)
    window = _as_window(window)
    dq, dk = attention_block_sizes()
    bq = _block(block_q, dq, T, "block_q")
    bk = _block(block_k, dk, S, "block_k")
    full = (B, N, T, S)
    has_mask, has_bias, has_seg = mask is not None, bias is not None, segment_ids is not None
    mask = _as_mask(mask, full)
    ids = _as_segments(segment_ids, B, T, S)
    q_ids, kv_ids = ids if has_seg else (jnp.zeros((1, 1), jnp.int32),) * 2
    # A bias is a differentiable argument only when given: without one, nothing (not
    # even a zero tangent) is added to what the backward keeps.
    extra = (_as_bias(bias, full),) if has_bias else ()
    if any(not is_symbolic_dim(d) and d == 0 for d in (B, T, N, S, H)):
        # Nothing to compute (as jax.nn, which returns this shape): no query row, or no
        # key, which leaves every row nothing to attend, and such a row gives 0.
        return jnp.zeros(q.shape, q.dtype)
    return needs_devices(
        _attention(
            q,
            k,
            v,
            mask,
            q_ids,
            kv_ids,
            *extra,
            causal=bool(causal),
            scale=float(scale),
            bq=bq,
            bk=bk,
            has_mask=has_mask,
            has_bias=has_bias,
            has_seg=has_seg,
            cap=cap,
            window=window,
        )
    )
