"""Fused linear + softmax cross-entropy that never holds the ``[N, V]`` logits.

``loss[n] = logsumexp_v(x[n] @ w) - (x[n] @ w)[labels[n]]``, computed ``chunk_size`` rows
at a time in a ``lax.scan``. The forward keeps ``x``, ``w``, the labels and the per-row
logsumexp (``N`` floats). The backward recomputes one chunk of logits at a time,
``p = exp(logits - lse)``, and accumulates ``dx = (g (p - onehot)) w^T`` and
``dw += x^T (g (p - onehot))`` chunk by chunk, so its memory beyond inputs and outputs
is ``O(chunk_size * V)`` instead of ``O(N * V)``. See ``docs/attention.md``.

Under a sharded program the loops of the forward, the backward and the reduced path run
on each device's own rows (:func:`cannjax._src.core.partitioned.row_local`): rows
sharded over devices stay there, a head sharded over the vocabulary is used as it is
(Megatron-LM's vocabulary-parallel cross-entropy: the per-row statistics and ``dx`` are
summed over its devices), and the weight gradient is summed once after the loop.

That bound holds whatever XLA fuses (XLA:CPU fuses differently on different CPUs): a
step makes its ``[chunk, V]`` arrays in a chain (logits, shifted logits, probabilities,
``d loss / d logits``), each operation reading one of them and nothing reading one
after the next is made (:func:`_row_stats`), so each can be written over the last. The
compiled temp of ``value_and_grad`` of the per-row loss is one ``[chunk, V]`` array
(two with a cap) plus the ``[D, V]`` product ``x^T G`` before it is added to ``dw``;
``tests/test_linear_cross_entropy.py`` checks it under XLA:CPU's fusion options.

Label smoothing, z-loss and the logit soft-cap (``cannjax._src.ops.losses``) live inside
the same chunks: each chunk's logits are capped, its loss gets the smoothing and z-loss
terms, and its ``d loss / d logits`` (:func:`_dlogits`) their derivatives. They keep
nothing more: the per-row ``lse`` (of the capped logits) is all the z-loss needs, and
the cap's derivative is recomputed from the chunk's logits.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.export import is_symbolic_dim
from jax.typing import ArrayLike

from cannjax._src.core import dots
from cannjax._src.core.dtypes import compute_dtype
from cannjax._src.core.operator import defop, registered
from cannjax._src.core.partitioned import Layout, Shards, bound, needs_devices, row_local
from cannjax._src.core.registry import EdgeCase, Level, written_for
from cannjax._src.core.validate import dense_operands
from cannjax._src.core.vma import varying_like
from cannjax._src.ops.linalg import weight_grad
from cannjax._src.ops.losses import (
    cap_slope,
    check_ignore_index,
    loss_options,
    plain_loss,
    soft_cap,
)

_FN = "cannjax.ops.linear_cross_entropy"
# Default chunk: about 64 MiB of float32 logits (512 rows at V = 32768), at least 64
# rows. Narrow chunks make skinny matmuls and cost time; 512 rows came closest to plain
# x @ w + optax in time while keeping the compiled temp memory a small fraction of
# plain's (value_and_grad at N=4096, D=256, V=32768; the figures are in
# docs/performance.md).
_CHUNK_BYTES = 64 * 2**20
_MIN_CHUNK, _MAX_CHUNK = 64, 512  # rows; the cap keeps small vocabularies chunked


_REDUCTIONS = ("none", "sum", "mean")
_WHOLE = Shards()  # one device's view: nothing split


def _as_labels(labels):
    dtype = getattr(labels, "dtype", None)
    if dtype is None:
        labels = jnp.asarray(labels)
        dtype = labels.dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
            f"{_FN}: labels must be an integer array of class indices, got "
            f"{jnp.dtype(dtype).name}{list(jnp.shape(labels))}; use labels.astype(jnp.int32)"
        )
    return jnp.asarray(labels)


def _chunk(chunk_size, n, V):
    if chunk_size is None:
        if is_symbolic_dim(V):
            raise ValueError(
                f"{_FN}: the default chunk_size is chosen from the vocabulary size "
                f"V = w.shape[1], which is symbolic ({V}); pass chunk_size (rows per step) "
                "explicitly to export with a symbolic V"
            )
        rows = min(_MAX_CHUNK, max(_MIN_CHUNK, _CHUNK_BYTES // (4 * V) // 8 * 8))
    elif isinstance(chunk_size, (bool, np.bool_)) or not isinstance(chunk_size, (int, np.integer)):
        raise TypeError(f"{_FN}: chunk_size must be an int or None, got {chunk_size!r}")
    elif chunk_size < 1:
        raise ValueError(f"{_FN}: chunk_size must be >= 1, got {chunk_size}")
    else:
        rows = int(chunk_size)
    # A symbolic row count (jax.export) cannot be compared with the chunk: the chunk
    # stays as chosen and the rows are padded to a whole number of chunks.
    return rows if is_symbolic_dim(n) else max(1, min(n, rows))


# ------------------------------------------------------------------------------ chunks
def _chunks(x, labels, chunk, ignore_index, strided=False):
    """``(xs, ls, N)``: ``x [N, D]`` and the labels padded to whole chunks of ``chunk``
    rows and viewed as chunks (:func:`_view`); padded rows get label ``ignore_index``
    (-1 when None: the padded rows are cut off again, and their cotangents are 0)."""
    N = x.shape[0]
    n = (N + chunk - 1) // chunk  # symbolic under jax.export
    if not is_symbolic_dim(N) and N == 0:
        n = 1  # no rows: one chunk of padding (a strided scan over none cannot index one)
    pad = n * chunk - N
    x = jnp.pad(x, ((0, pad), (0, 0)))
    fill = -1 if ignore_index is None else ignore_index
    labels = jnp.pad(labels, (0, pad), constant_values=fill)
    return _view(x, chunk, strided), _view(labels, chunk, strided), N


# Chunks are contiguous (``[n, chunk, ...]``, chunk k = rows k*chunk ...) or strided
# (``[chunk, n, ...]``, chunk k = rows k, k + n, k + 2n, ...). Where the partitioner
# splits a loop itself (``row_local`` cannot: a program whose mesh is unknown), strided
# chunks keep the rows' own axis leading, so rows sharded over devices stay where they
# are; the forward and the tangent walk strided chunks. A loop that sums over the rows
# (the weight gradient) is contiguous: over strided chunks the partitioner would
# all-reduce its sum at every chunk.
def _view(v, chunk, strided):
    """Padded rows ``v [n * chunk, ...]`` as chunks (a reshape: no copy)."""
    n = v.shape[0] // chunk
    return v.reshape(chunk, n, *v.shape[1:]) if strided else v.reshape(n, chunk, *v.shape[1:])


def _padded(v, ls, strided):
    """Per-row ``v [N]`` padded and viewed as the labels' chunks ``ls``."""
    chunk = ls.shape[0] if strided else ls.shape[1]
    return _view(jnp.pad(v, (0, ls.size - v.shape[0])), chunk, strided)


def _scan_chunks(step, carry, views, strided):
    """``lax.scan`` over chunks: ``step(carry, chunks)`` gets chunk ``k`` of each view
    (``[chunk, ...]``); per-chunk outputs are stacked ``[n, chunk, ...]``."""
    if not strided:
        return lax.scan(step, carry, tuple(views))
    n = views[0].shape[1]

    def body(c, k):
        return step(c, tuple(lax.dynamic_index_in_dim(v, k, axis=1, keepdims=False) for v in views))

    return lax.scan(body, carry, jnp.arange(n))


def _rows(ys, N, strided):
    """Per-chunk outputs ``[n, chunk, ...]`` of :func:`_scan_chunks` as rows ``[N, ...]``."""
    ys = ys.swapaxes(0, 1) if strided else ys
    return ys.reshape(-1, *ys.shape[2:])[:N]


def _logits(xc, w, acc):
    return dots.matmul(xc, w, out_dtype=acc)


def _local_labels(lc, shards, local_size):
    """The labels as column indices of this device's part of the vocabulary."""
    if not shards.vocab:
        return lc
    return lc - shards.vocab_offset(local_size).astype(lc.dtype)


def _onehot(lc, V):
    # The iota in the labels' dtype: int32 against int64 labels (x64) is a promotion,
    # an error under jax.numpy_dtype_promotion("strict").
    return lax.broadcasted_iota(lc.dtype, (lc.shape[0], V), 1) == lc[:, None]


def _minus(v, m):
    """``v - m`` for the row maxima ``m`` of :func:`_row_stats`: in a row holding ``+inf``
    (``m = +inf``) 0 at the ``+inf`` entries and ``-inf`` elsewhere, as
    :func:`cannjax._src.ops.rowwise.shifted_exp` takes it, save that a NaN there counts
    as ``+inf``. It reads ``v - m`` alone, never ``v`` again (``shifted_exp`` does, for
    its ``+inf`` test), so wherever XLA makes ``v - m`` in a fusion of its own the
    result can be written over it."""
    d = v - m  # in a +inf row: -inf, or NaN at the +inf entries (inf - inf)
    return jnp.where(m == jnp.inf, jnp.where(jnp.isnan(d), 0.0, -jnp.inf), d)


class _Stats(NamedTuple):
    """Per-row results of a chunk, ``[c]`` each, in the order the scan step returns them:
    where nothing else decides it, XLA:CPU's scheduler follows that order, and the reads
    of ``zs`` for ``mean_zs`` should come before ``e`` is made."""

    picked: jax.Array  # zs[label]
    mean_zs: jax.Array | None  # mean(zs), with label smoothing
    m: jax.Array
    log_s: jax.Array


def _row_stats(logits, lc, smoothing, cap, shards=_WHOLE):
    """``(stats, e, s, t)`` of one chunk of logits ``[c, V]`` and labels ``[c]``.

    ``z, t = soft_cap(logits, cap)``; ``m`` = the row max of ``z``, ``zs = z - m``,
    ``e = exp(zs)`` and ``s = sum(e)`` (kept axis), as
    :func:`cannjax._src.ops.rowwise.shifted_exp` makes them; ``stats`` holds what
    :func:`_row_loss` needs.

    Memory: one ``[c, V]`` array at a time, whatever XLA fuses (its fusion choices
    depend on the CPU it compiles for). The chain ``z -> zs -> e`` reads one ``[c, V]``
    array per step, so each can be written over the last, provided nothing reads an
    earlier one later. Hence ``zs[label]`` comes from ``z[label]``, gathered before
    ``zs`` is made: the max is taken with it (a no-op, it is one of the row's entries),
    so ``zs`` depends on it. And the loss, which needs ``s``, is made after the scan
    from ``stats``: made here, XLA would fuse the gather into it, after ``e``.

    With the vocabulary split over ``shards.vocab`` (``logits`` one device's columns),
    the row max, the label's logit and the sums are reduced over those axes.
    """
    z, t = soft_cap(logits, cap)
    V = logits.shape[1]
    # With a cap, z = cap t: the label's entry and the row max are read from t and
    # scaled, exactly (cap > 0 keeps the order, and rounding is monotonic), so no step
    # needs z and t at once.
    src, scale = (z, None) if t is None else (t, cap)
    local = _local_labels(lc, shards, V)
    z_label = jnp.take_along_axis(src, jnp.clip(local, 0, V - 1)[:, None], axis=1)
    if shards.vocab:  # the label's column lives on one device
        here = ((local >= 0) & (local < V))[:, None]
        z_label = shards.vocab_max(jnp.where(here, z_label, -jnp.inf))
    row_max = shards.vocab_max(jnp.max(src, -1, keepdims=True, initial=-jnp.inf))
    if scale is not None:
        z_label, row_max = scale * z_label, scale * row_max
    top = jnp.maximum(row_max, z_label)
    m = jnp.where(jnp.isfinite(top), top, jnp.zeros((), top.dtype))
    m = jnp.where(top == jnp.inf, top, m)
    zs = _minus(z, m)
    e = jnp.exp(zs)
    s = shards.vocab_sum(jnp.sum(e, -1, keepdims=True))
    mean_zs = shards.vocab_sum(jnp.sum(zs, -1)) / (V * shards.vocab_size()) if smoothing else None
    stats = _Stats(_minus(z_label, m)[:, 0], mean_zs, m[:, 0], jnp.log(s[:, 0]))
    return stats, e, s, t


def _row_loss(stats, labels, ignore_index, smoothing, z_loss, classes=None):
    """``(loss, lse)`` per row from :func:`_row_stats`' ``stats``: ``lse = m + log(s)``;
    the loss is ``log(s) - zs[label]`` (exact for logits of 1e4), with smoothing ``(1 -
    eps)`` times that plus ``eps (log(s) - mean(zs))``, plus ``z_loss lse^2``; 0 where
    ignored. With ``classes`` (the one-hot reading), a label outside ``[0, classes)``
    picks nothing: its first term is 0."""
    log_s = stats.log_s
    lse = stats.m + log_s
    loss = log_s - stats.picked
    if classes is not None:
        loss = jnp.where((labels >= 0) & (labels < classes), loss, 0.0)
    if smoothing:
        loss = (1 - smoothing) * loss + smoothing * (log_s - stats.mean_zs)
    if z_loss:
        loss = loss + z_loss * jnp.square(lse)
    return jnp.where(_kept(labels, ignore_index), loss, 0.0), lse


def _kept(labels, ignore_index):
    """The rows not ignored (all of them when ``ignore_index`` is None)."""
    return True if ignore_index is None else labels != ignore_index


def _unchunked(stats, N, strided):
    return jax.tree.map(lambda v: _rows(v, N, strided), stats)


def _dlogits(p, lse, t, lc, V, smoothing, z_loss, one_hot=False, shards=_WHOLE):
    """``d loss / d logits`` of a chunk from ``p = softmax(z)``: ``p (mass + 2 z_loss lse)
    - (1 - eps) onehot - eps / V``, times ``dz/dx = (1 - t)(1 + t)`` with a cap (``t =
    tanh(logits / cap)``, else None). ``mass``, the sum of the target, is 1, but ``eps``
    with ``one_hot`` where a label outside ``[0, V)`` picks no class. Not zeroed on
    ignored rows. ``V``: the whole vocabulary; ``p`` holds this device's columns of it
    when ``shards.vocab`` splits it."""
    mass = jnp.where((lc >= 0) & (lc < V), 1.0, smoothing)[:, None] if one_hot else 1.0
    if z_loss:
        p = p * (mass + 2 * z_loss * lse[:, None])
    elif one_hot:
        p = p * mass
    # The one-hot cast explicitly: bool and float do not mix under strict promotion. A
    # select in its place makes XLA's elementwise library fusion hold a second [c, V].
    onehot = _onehot(_local_labels(lc, shards, p.shape[1]), p.shape[1]).astype(p.dtype)
    if smoothing:
        d = p - (1 - smoothing) * onehot - smoothing / V
    else:
        d = p - onehot
    return d if t is None else d * cap_slope(t)


# ------------------------------------------------------------------------------ per-row
def _forward(x, w, labels, *, chunk, ignore_index, smoothing, z_loss, cap, one_hot=False):
    local = bound(
        _forward_rows, **_options(chunk, ignore_index, smoothing, z_loss, cap), one_hot=one_hot
    )
    loss, lse = row_local(local, _FORWARD_LAYOUT, x, w, labels)
    return loss, {"x": x, "w": w, "labels": labels, "lse": lse}


def _forward_rows(x, w, labels, *, chunk, ignore_index, smoothing, z_loss, cap, one_hot,
                  shards):  # fmt: skip
    """:func:`_forward` on one device's rows (and columns of ``w``): ``[loss, lse]``."""
    acc = compute_dtype(x.dtype)
    xs, ls, N = _chunks(x, labels, _local_chunk(chunk, x.shape[0]), ignore_index, strided=True)

    def step(_, xl):
        xc, lc = xl
        stats, *_ = _row_stats(_logits(xc, w, acc), lc, smoothing, cap, shards)
        return None, stats

    _, stats = _scan_chunks(step, None, (xs, ls), True)
    classes = w.shape[1] * shards.vocab_size() if one_hot else None
    loss, lse = _row_loss(
        _unchunked(stats, N, True), labels, ignore_index, smoothing, z_loss, classes
    )
    return [loss.astype(x.dtype), lse]


_FORWARD_LAYOUT = Layout(ins=("nd", "dv", "n"), outs=("n", "n"), vocab_of=1)


def _backward(res, g, *, chunk, ignore_index, smoothing, z_loss, cap, one_hot=False):
    # d loss[n] / d logits[n] = p[n] - onehot(labels[n]),  p = exp(logits - lse);
    # with G = g[:, None] * (p - onehot): dx = G w^T (per chunk), dw = sum_chunks x^T G.
    # With the options p = exp(z - lse) of the capped logits z and G as in _dlogits.
    x, w = res["x"], res["w"]
    local = bound(
        _backward_rows, **_options(chunk, ignore_index, smoothing, z_loss, cap), one_hot=one_hot
    )
    dx, dw = row_local(local, _BACKWARD_LAYOUT, x, w, res["labels"], res["lse"], g)
    return dx, dw.astype(w.dtype)


def _backward_rows(x, w, labels, lse, g, *, chunk, ignore_index, smoothing, z_loss, cap,
                   one_hot, shards):  # fmt: skip
    """:func:`_backward` on one device's rows (and columns of ``w``): ``[dx, dw]``."""
    acc, (D, Vl) = compute_dtype(x.dtype), w.shape
    V = Vl * shards.vocab_size()
    xs, ls, N = _chunks(x, labels, _local_chunk(chunk, x.shape[0]), ignore_index)
    lses, gs = _padded(lse, ls, False), _padded(g.astype(acc), ls, False)

    def step(dw, xlg):
        xc, lc, lsec, gc = xlg
        z, t = soft_cap(_logits(xc, w, acc), cap)
        p = jnp.exp(z - lsec[:, None])
        gc = jnp.where(_kept(lc, ignore_index), gc, 0.0)
        dl = _dlogits(p, lsec, t, lc, V, smoothing, z_loss, one_hot, shards) * gc[:, None]
        dl = dl.astype(x.dtype)
        dxc = dots.matmul_t(dl, w, out_dtype=acc)
        dw = dw + weight_grad(xc, dl, acc)
        return dw, _partial_rows(dxc, x.dtype, shards)

    dw0 = varying_like(jnp.zeros((D, Vl), acc), x, w, labels, lse, g)  # under shard_map
    dw, dx = _scan_chunks(step, dw0, (xs, ls, lses, gs), False)
    dx = shards.vocab_sum(_rows(dx, N, False)).astype(x.dtype)
    return [dx, shards.rows_sum(dw)]


# Rows (n) stay where the program put them, the vocabulary (v) of w too where its axes
# are not the rows' (core/partitioned.py); the model width (d) is gathered.
_BACKWARD_LAYOUT = Layout(ins=("nd", "dv", "n", "n", "n"), outs=("nd", "dv"), vocab_of=1)


def _partial_rows(dxc, dtype, shards):
    """A chunk's ``G w^T``: in ``x``'s dtype, but kept at full precision while it is a
    partial sum over a split vocabulary (summed over devices after the loop)."""
    return dxc if shards.vocab else dxc.astype(dtype)


def _local_chunk(chunk, n):
    """The chunk for ``n`` rows on one device: at most ``n`` (no chunk of padding)."""
    return chunk if is_symbolic_dim(n) else max(1, min(n, chunk))


def _options(chunk, ignore_index, smoothing, z_loss, cap) -> dict:
    """The static options every row loop takes, as keywords."""
    return {"chunk": chunk, "ignore_index": ignore_index, "smoothing": smoothing,
            "z_loss": z_loss, "cap": cap}  # fmt: skip


def _tangent(res, tx, tw, *, chunk, ignore_index, smoothing, z_loss, cap, one_hot=False):
    # d loss[n] = sum_v p[n, v] dlogits[n, v] - dlogits[n, labels[n]],
    # dlogits = dx w + x dw, recomputed chunk by chunk; with the options
    # d loss[n] = sum_v G[n, v] dlogits[n, v], G as in _dlogits.
    x, w, labels = res["x"], res["w"], res["labels"]
    acc, V = compute_dtype(x.dtype), w.shape[1]
    xs, ls, N = _chunks(x, labels, chunk, ignore_index, strided=True)
    txs = _chunks(tx, labels, chunk, ignore_index, strided=True)[0]
    lses = _padded(res["lse"], ls, True)

    def step(_, xs_):
        xc, txc, lc, lsec = xs_
        z, t = soft_cap(_logits(xc, w, acc), cap)
        p = jnp.exp(z - lsec[:, None])
        dlog = _logits(txc, w, acc) + _logits(xc, tw, acc)
        if smoothing or z_loss or cap is not None or one_hot:  # no pick outside [0, V)
            dloss = (_dlogits(p, lsec, t, lc, V, smoothing, z_loss, one_hot) * dlog).sum(-1)
        else:
            picked = jnp.take_along_axis(dlog, jnp.clip(lc, 0, V - 1)[:, None], axis=1)[:, 0]
            dloss = (p * dlog).sum(-1) - picked
        return None, jnp.where(_kept(lc, ignore_index), dloss, 0.0)

    _, out = _scan_chunks(step, None, (xs, txs, ls, lses), True)
    return _rows(out, N, True).astype(tx.dtype)


_STATIC = ("chunk", "ignore_index", "smoothing", "z_loss", "cap", "one_hot")
_lce = defop(
    "linear_cross_entropy",
    forward=jax.jit(_forward, static_argnames=_STATIC),
    tangent=jax.jit(_tangent, static_argnames=_STATIC),
    backward=jax.jit(_backward, static_argnames=_STATIC),
    nondiff_argnums=(2,),
    residuals={
        "x": "the inputs [N, D] (an input)",
        "w": "the weights [D, V] (an input)",
        "labels": "the integer labels [N] (an input)",
        "lse": "per-row logsumexp of the (capped) logits [N], float32",
    },
    level=Level.DERIVED,
    reuse=(),
)


# ------------------------------------------------------------------------------ reduced
# reduction="sum" / "mean": loss = s * sum_n loss[n] is a scalar, so its cotangent g is
# one number and the gradients are g times ones the forward can already compute:
#   dx = s G w^T,  dw = s x^T G,  G = (p - onehot) on rows not ignored
# (with the options, G as in _dlogits).
# The forward makes them chunk by chunk (3 products: logits, G w^T, x^T G), keeps them,
# and the backward only scales; the tangent is <dx, tx> + <dw, tw>.
def _reduced_forward(x, w, labels, *, chunk, ignore_index, mean, smoothing, z_loss, cap):
    acc = compute_dtype(x.dtype)
    if not mean:
        scale = jnp.ones((), acc)
    elif ignore_index is None:  # every row counts: a number known at trace time
        scale = 1 / jnp.asarray(labels.shape[0], acc)
    else:
        scale = 1 / jnp.maximum((labels != ignore_index).sum(), 1).astype(acc)
    local = bound(_reduced_rows, **_options(chunk, ignore_index, smoothing, z_loss, cap))
    loss, dx, dw = row_local(local, _REDUCED_LAYOUT, x, w, labels, scale)
    loss = (loss.sum() * scale).astype(x.dtype)
    return loss, {"dx": dx, "dw": dw.astype(w.dtype)}


def _reduced_rows(x, w, labels, scale, *, chunk, ignore_index, smoothing, z_loss, cap, shards):
    """:func:`_reduced_forward` on one device's rows (and columns of ``w``): the rows'
    losses (not scaled), ``dx`` and ``dw`` (scaled)."""
    acc, (D, Vl) = compute_dtype(x.dtype), w.shape
    V = Vl * shards.vocab_size()
    xs, ls, N = _chunks(x, labels, _local_chunk(chunk, x.shape[0]), ignore_index)

    def step(dw, xl):
        xc, lc = xl
        stats, e, s, t = _row_stats(_logits(xc, w, acc), lc, smoothing, cap, shards)
        lse = stats.m + stats.log_s
        grad = _dlogits(e / s, lse, t, lc, V, smoothing, z_loss, shards=shards)
        grad = grad * (
            scale if ignore_index is None else jnp.where(lc != ignore_index, scale, 0.0)[:, None]
        )
        grad = grad.astype(x.dtype)
        dxc = dots.matmul_t(grad, w, out_dtype=acc)
        return dw + weight_grad(xc, grad, acc), (_partial_rows(dxc, x.dtype, shards), stats)

    dw0 = varying_like(jnp.zeros((D, Vl), acc), x, w, labels)
    dw, (dx, stats) = _scan_chunks(step, dw0, (xs, ls), False)
    loss, _ = _row_loss(_unchunked(stats, N, False), labels, ignore_index, smoothing, z_loss)
    dx = shards.vocab_sum(_rows(dx, N, False)).astype(x.dtype)
    return [loss, dx, shards.rows_sum(dw)]


_REDUCED_LAYOUT = Layout(ins=("nd", "dv", "n", ""), outs=("n", "nd", "dv"), vocab_of=1)


def _reduced_backward(res, g, *, chunk, ignore_index, mean, smoothing, z_loss, cap):
    return (g * res["dx"]).astype(res["dx"].dtype), (g * res["dw"]).astype(res["dw"].dtype)


def _reduced_tangent(res, tx, tw, *, chunk, ignore_index, mean, smoothing, z_loss, cap):
    acc = compute_dtype(tx.dtype)
    dot = jnp.vdot(res["dx"].astype(acc), tx.astype(acc)) + jnp.vdot(
        res["dw"].astype(acc), tw.astype(acc)
    )
    return dot.astype(tx.dtype)


_STATIC_REDUCED = ("chunk", "ignore_index", "mean", "smoothing", "z_loss", "cap")
_lce_reduced = defop(
    "linear_cross_entropy_reduced",
    forward=jax.jit(_reduced_forward, static_argnames=_STATIC_REDUCED),
    tangent=_reduced_tangent,
    backward=_reduced_backward,
    nondiff_argnums=(2,),
    residuals={
        "dx": "the gradient of the loss w.r.t. x, [N, D]",
        "dw": "the gradient w.r.t. w, [D, V]",
    },
    level=Level.DERIVED,
    reuse=(),
)


# ------------------------------------------------------------------------------ public
def _reference(x, w, labels, *, chunk_size=None, ignore_index=-100, reduction="none",
               label_smoothing=0.0, z_loss=0.0, logit_cap=None):  # fmt: skip
    """``optax.softmax_cross_entropy_with_integer_labels(x @ w, labels)`` (with the options,
    optax's smoothed ``softmax_cross_entropy`` of the capped logits plus the z-loss), 0
    where ignored, then summed or averaged over the rows not ignored."""
    del chunk_size
    valid = jnp.ones(labels.shape, bool) if ignore_index is None else labels != ignore_index
    safe = jnp.where(valid, labels, 0)
    loss = plain_loss(
        x @ w, safe, label_smoothing=label_smoothing, z_loss=z_loss, logit_cap=logit_cap
    )
    loss = jnp.where(valid, loss, jnp.zeros((), loss.dtype))
    if reduction == "none":
        return loss
    total = loss.sum()
    return total / jnp.maximum(valid.sum(), 1).astype(total.dtype) if reduction == "mean" else total


def _sample(key):
    kx, kw, kl = jax.random.split(key, 3)
    x = jax.random.normal(kx, (6, 4), jnp.float32)
    w = jax.random.normal(kw, (4, 5), jnp.float32)
    labels = jax.random.randint(kl, (6,), 0, 5)
    return x, w, labels.at[2].set(-100)


def _edges():
    x, w, labels = _sample(jax.random.key(3))
    big = jnp.asarray([[1e4, -1e4, 0.5, 3.0], [-1e4, 2.0, 1e4 - 1, -60.0], [1e4, 1e4, 1e4, 1e4],
                       [-1e4, -1e4, -1e4, -1e4], [0.5, 90.0, -1e4, 1.0], [40.0, -3.0, 1e4, 0.0]],
                      jnp.float32)  # fmt: skip
    pick = jnp.eye(4, 5, dtype=jnp.float32).at[0, 4].set(1.0)  # logits [x0, x1, x2, x3, x0]
    return [
        # Every row ignored: loss 0, gradients 0.
        EdgeCase((x, w, jnp.full((6,), -100)), expected_value=jnp.zeros(6)),
        # Large logits (|x @ w| ~ 1e2): the logsumexp must not overflow.
        EdgeCase((x * 30.0, w, labels), kwargs={"chunk_size": 4}),
        # Leading dimensions [2, 3, D].
        EdgeCase((x.reshape(2, 3, 4), w, labels.reshape(2, 3)), kwargs={"chunk_size": 5}),
        # Mean over no row: 0 (not 0 / 0), gradients 0.
        EdgeCase(
            (x, w, jnp.full((6,), -100)),
            kwargs={"reduction": "mean"},
            expected_value=jnp.zeros(()),
        ),
        EdgeCase((x * 30.0, w, labels), kwargs={"reduction": "mean", "chunk_size": 4}),
        # Logits of 1e4 soft-capped at 30, with smoothing and z-loss: tanh saturates
        # (gradient 0 there). x @ w is exact here (w picks entries of x), since the
        # rounding of a sum of products of 1e4 (1e-3 in float32) would move sech^2(z / 30)
        # by more than the tolerance. Finite differences are off: their step on w (1e-4
        # at w = 0) moves the logits by 1, where sech^2(z / 30) changes on that scale;
        # gradients and second order are checked against the reference.
        EdgeCase(
            (big, pick, labels), kwargs={**_OPTIONS, "chunk_size": 4}, finite_differences=False
        ),
    ]


_OPTIONS = {"label_smoothing": 0.1, "z_loss": 1e-3, "logit_cap": 30.0}


# One public function, two operators: registered with the per-row operator's metadata
# (name, level, reuse, nondiff_argnums); the reduced operator's residuals are listed too,
# under the reduction that selects it.
@registered(
    _lce,
    reference=_reference,
    sample=_sample,
    residuals={
        **_lce.residuals,
        "dx": "reduction='sum'/'mean' only (instead of all the above): "
        + _lce_reduced.residuals["dx"],
        "dw": "reduction='sum'/'mean' only: " + _lce_reduced.residuals["dw"],
    },
    configs=(
        {},
        {"chunk_size": 4},
        {"chunk_size": 1},
        {"reduction": "mean"},
        {"reduction": "sum", "chunk_size": 4},
        {"label_smoothing": 0.1, "z_loss": 0.01, "logit_cap": 3.0, "chunk_size": 4},
        {"label_smoothing": 0.2, "z_loss": 0.01, "logit_cap": 3.0, "reduction": "mean"},
    ),
    # Uncapped unless a case says otherwise: at logits of 1e2 (x * 30) float32 rounds
    # tanh near 1, so the cap's slope (1 - t)(1 + t) carries an absolute error of 1e-7
    # per logit, in plain autodiff as here, and their gradients differ by more than
    # check_op's tolerance (both 1e-5 from float64). The cap has its own edge case.
    edges=written_for({"reduction": "none", "logit_cap": None}, _edges),
    doc="Fused x @ w + softmax cross-entropy, chunked; never holds the [N, V] logits.",
)
def linear_cross_entropy(
    x: ArrayLike,
    w: ArrayLike,
    labels: ArrayLike,
    *,
    chunk_size: int | None = None,
    ignore_index: int | None = -100,
    reduction: str = "none",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_cap: float | None = None,
) -> jax.Array:
    """Per-example softmax cross-entropy of the logits ``x @ w``, computed in chunks.

    By default the same math as ``optax.softmax_cross_entropy_with_integer_labels(x @ w,
    labels)``::

      logits = x @ w                                   # never held whole
      loss[n] = logsumexp(logits[n]) - logits[n, labels[n]]
      loss[n] = 0 where labels[n] == ignore_index      # and no gradient from that row

    With the options, as :func:`cannjax.ops.softmax_cross_entropy` (``eps =
    label_smoothing``, ``V`` classes)::

      z       = logit_cap * tanh(logits / logit_cap)  if logit_cap else logits
      lse     = logsumexp(z[n])
      loss[n] = lse - (1 - eps) z[n, labels[n]] - (eps / V) sum_v z[n, v] + z_loss lse^2

    with ``d loss[n] / d logits[n] = (1 - (z / cap)^2) (p (1 + 2 z_loss lse) - (1 - eps)
    onehot - eps / V)``, ``p = softmax(z[n])``. Every term lives inside the chunks: the
    forward keeps the same residuals (``lse`` is of ``z``, and all the z-loss needs), the
    backward recomputes ``z`` and the cap's slope from each chunk's logits, and the
    ``"sum"`` / ``"mean"`` path folds them into the gradients it makes in the forward.
    The logits of ``x @ w`` are finite, so smoothing spreads over all ``V`` classes
    (``softmax_cross_entropy`` leaves out classes at ``-inf``).

    Work proceeds ``chunk_size`` rows at a time; the backward recomputes each chunk's
    logits from the saved per-row logsumexp and accumulates the gradients of ``x`` and
    ``w`` chunk by chunk (see the module docstring for the memory), as Cut Cross-Entropy
    (Wijmans et al.) does.

    Args:
      x: inputs ``[..., D]``, floating point.
      w: weights ``[D, V]``, floating point (promoted with ``x`` to a common dtype).
      labels: integer class indices of shape ``x.shape[:-1]``, in ``[0, V)`` or equal to
        ``ignore_index``. Not differentiated. Other values are clipped into ``[0, V)``.
      chunk_size: rows per step; by default about 64 MiB of float32 logits per chunk,
        between 64 and 512 rows, and at most the number of rows. Under ``jax.export``
        with a symbolic number of rows, the rows are padded to a whole number of chunks.
      ignore_index: label value that contributes loss 0 and gradient 0 (PyTorch's and
        Liger-Kernel's convention; default -100), or None: every row counts, as in
        optax, and ``"mean"`` divides by the number of rows, known at trace time (no
        count to reduce across devices when the rows are sharded).
      reduction: ``"none"`` (per-row losses), ``"sum"`` (their sum) or ``"mean"`` (the
        sum divided by the number of rows not ignored; 0 when every row is ignored,
        where PyTorch gives NaN). With a scalar loss the cotangent is one number, so
        the forward computes the gradients too (``dx = s G w^T``, ``dw = s x^T G``,
        ``G = p - onehot``, ``s`` = 1 or 1 / count) and keeps them instead of the
        logsumexp, as Liger-Kernel's fused linear cross-entropy does: 3 products in
        all instead of 4 (no logits recomputed), for an
        ``[N, D]`` plus a ``[D, V]`` residual. Under ``jax.jit`` the gradient work of
        a forward whose residuals are unused (no differentiation) is dead code and
        removed.
      label_smoothing: ``eps`` in ``[0, 1)``, a Python float; default 0.
      z_loss: weight of ``lse^2``, a Python float ``>= 0`` (PaLM: 1e-4); default 0.
      logit_cap: ``None`` (default) or a Python float ``> 0``: soft-caps the logits to
        ``(-logit_cap, logit_cap)`` before the softmax (Gemma 2: 30.0).

    Returns:
      Loss of shape ``x.shape[:-1]`` (``reduction="none"``) or a scalar, in the common
      dtype of ``x`` and ``w``.

    Raises:
      TypeError: non-floating ``x`` or ``w``, non-integer labels, non-int
        ``chunk_size`` / ``ignore_index``, or a hyperparameter that is not a Python
        number.
      ValueError: ``w`` not of shape ``[D, V]`` with ``D == x.shape[-1]``, labels of a
        shape other than ``x.shape[:-1]``, ``chunk_size < 1``, an unknown
        ``reduction``, ``label_smoothing`` outside ``[0, 1)``, ``z_loss < 0``,
        ``logit_cap <= 0``, or ``chunk_size=None`` with a symbolic vocabulary size ``V``
        (under ``jax.export``; symbolic leading dimensions are supported,
        docs/export.md).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from cannjax.ops import linear_cross_entropy
      >>> x, w = jnp.ones((4, 3)), jnp.zeros((3, 5))
      >>> linear_cross_entropy(x, w, jnp.array([0, 1, 2, -100]))  # log(5) = 1.609...
      Array([1.609438, 1.609438, 1.609438, 0.      ], dtype=float32)
      >>> jax.grad(lambda w: linear_cross_entropy(x, w, jnp.array([0, 1, 2, 3])).sum())(w).shape
      (3, 5)
      >>> linear_cross_entropy(x, w, jnp.array([0, 1, 2, -100]), reduction="mean")
      Array(1.609438, dtype=float32)
      >>> loss = linear_cross_entropy(  # uniform logits: smoothing is moot
      ...     x, w, jnp.array([0, 1, 2, -100]), reduction="mean", label_smoothing=0.1,
      ...     z_loss=1e-4, logit_cap=30.0)
      >>> round(float(loss), 6)  # log(5) + 1e-4 log(5)^2
      1.609697

    References:
      Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models", 2024.
      https://arxiv.org/abs/2411.09009
      Hsu et al., "Liger Kernel: Efficient Triton Kernels for LLM Training", 2024 (fused
      linear cross-entropy with label smoothing, z-loss and soft-capping).
      https://arxiv.org/abs/2410.10989
      Szegedy et al., "Rethinking the Inception Architecture for Computer Vision", 2016
      (label smoothing). https://arxiv.org/abs/1512.00567
      Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways", 2022 (z-loss).
      https://arxiv.org/abs/2204.02311
      Gemma Team, "Gemma 2: Improving Open Language Models at a Practical Size", 2024
      (final-logit soft-capping). https://arxiv.org/abs/2408.00118
    """
    x, w = dense_operands(_FN, x, w, dims="D, V")
    labels = _as_labels(labels)
    if labels.shape != x.shape[:-1]:
        raise ValueError(
            f"{_FN}: labels must have shape x.shape[:-1] == {x.shape[:-1]}, got "
            f"labels.shape={labels.shape} (x.shape={x.shape})"
        )
    ignore_index = check_ignore_index(_FN, ignore_index, optional=True)
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"{_FN}: reduction must be one of {', '.join(map(repr, _REDUCTIONS))}, got "
            f"{reduction!r}"
        )
    dtype = jnp.promote_types(x.dtype, w.dtype)
    x, w = x.astype(dtype), w.astype(dtype)
    lead, (D, V) = x.shape[:-1], w.shape
    n = math.prod(lead)  # symbolic under jax.export
    chunk = _chunk(chunk_size, n, V)
    eps, zl, cap = loss_options(_FN, label_smoothing, z_loss, logit_cap)
    args = (x.reshape(n, D), w, labels.reshape(n))
    static = dict(chunk=chunk, ignore_index=ignore_index, smoothing=eps, z_loss=zl, cap=cap)
    if reduction != "none":
        return needs_devices(_lce_reduced(*args, **static, mean=reduction == "mean"))
    return needs_devices(_lce(*args, **static)).reshape(lead)


def one_hot_linear_cross_entropy(x, w, labels, *, label_smoothing=0.0, z_loss=0.0, logit_cap=None):
    """Per-row :func:`linear_cross_entropy` of labels read as one-hot targets
    (``jax.nn.one_hot`` of them): a label outside ``[0, V)``, negative ones included,
    picks no class, so its row is ``eps (lse - mean(z)) + z_loss lse^2``. No row is
    ignored. For :func:`cannjax.optimize`, which finds optax's losses of one-hot targets;
    the arguments are trusted (checked where the match was made)."""
    lead, (D, V) = x.shape[:-1], w.shape
    n = math.prod(lead)
    static = dict(
        chunk=_chunk(None, n, V),
        ignore_index=None,
        smoothing=float(label_smoothing),
        z_loss=float(z_loss),
        cap=None if logit_cap is None else float(logit_cap),
        one_hot=True,
    )
    return needs_devices(_lce(x.reshape(n, D), w, labels.reshape(n), **static)).reshape(lead)
