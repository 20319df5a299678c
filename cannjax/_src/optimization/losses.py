"""Cross-entropy found by meaning: ``log softmax(logits)[label]`` however it is read out.

The templates of :mod:`idioms` cover optax's and flax's losses. Libraries with named axes
write the same loss other ways: penzai indexes ``log_softmax`` with a batched ``gather``
(labels wrapped into ``[0, V)`` first), haliax contracts the one-hot labels with
``logsumexp(logits) - logits`` in one ``dot_general``. The finder here reads either
readout, then walks the logits back through an optional soft cap ``c * tanh(z / c)``
(Gemma 2's final logits), an optional slice of positions (``logits[:, :-1]``), to a head
product ``x @ w``: with one, the loss is :func:`cannjax.ops.linear_cross_entropy` and the
``[N, V]`` logits are never held whole.

Both readouts are proofs of the per-row value ``-log p[label] = logsumexp(z) - z[label]``:

- ``log_softmax`` and ``logsumexp`` are accepted as ``y - c - log(sum exp(y - c))`` and
  ``log(sum exp(y - c)) + c`` for any ``c`` constant along the class axis (it cancels);
- the one-hot is ``labels[..., None] == iota`` along the class axis, so a label outside
  ``[0, V)`` reads nothing: the replacement gives such rows 0, as the contraction does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore

from cannjax import ops
from cannjax._src.optimization.match import Graph, view_step
from cannjax._src.optimization.structural import _dims, _plain_precision, _scalar, linear_at
from cannjax._src.optimization.walk import is_identity, is_row_max, is_upcast, producer, soft_cap


def _through(g: Graph, v, covered: set):
    """``v`` through copies, same-dtype converts and ``* 1.0`` (haliax's weights)."""
    while True:
        i, e = producer(g, v)
        if e is None:
            return v
        if is_identity(e):
            v = e.invars[0]
        elif e.primitive.name == "mul" and _scalar(g, e.invars[1]) == 1.0:
            v = e.invars[0]
        elif e.primitive.name == "mul" and _scalar(g, e.invars[0]) == 1.0:
            v = e.invars[1]
        else:
            return v
        covered.add(i)


def view(g: Graph, v):
    """``(source, axis map, chain)``: ``v`` read from ``source`` through broadcasts, unit
    reshapes (:func:`match.view_step`), transposes and copies; the map gives, per axis of
    ``v``, the source axis it reads (None: a broadcast or unit axis)."""
    shape = tuple(v.aval.shape)
    amap, chain = list(range(len(shape))), []
    while True:
        i, e = producer(g, v)
        if e is None or len(e.invars) != 1:
            break
        name, src = e.primitive.name, e.invars[0]
        if is_identity(e):
            step = list(range(e.outvars[0].aval.ndim))
        elif name == "transpose":
            step = list(e.params["permutation"])
        else:
            step = view_step(e)
            if step is None:
                break
        amap = [None if a is None else step[a] for a in amap]
        chain.append(i)
        v = src
    return v, tuple(None if shape[a] == 1 else m for a, m in enumerate(amap)), chain


def _rows_of(amap, axis: int, rank: int) -> bool:
    """Whether ``amap`` reads a ``[rows]`` array: the class ``axis`` broadcast, the other
    axes in order."""
    rows = [a for a in range(rank) if a != axis]
    return (
        len(amap) == rank
        and amap[axis] is None
        and [amap[a] for a in rows] == list(range(rank - 1))
    )


def _row_shift(g: Graph, c, axis: int, rank: int):
    """``(source, chain)`` when ``c`` is a ``[rows]`` array broadcast along ``axis``."""
    src, amap, chain = view(g, c)
    if not isinstance(src, jcore.Var) or not _rows_of(amap, axis, rank):
        return None
    return src, chain


def _log_sum_exp(g: Graph, v, covered: set):
    """``(s, axis, amap)`` when ``v`` (through views) is ``log(sum_axis exp(s))``, the sum
    kept as a unit axis or not, ``|.|`` taken or not; ``amap`` maps ``v``'s axes to the
    sum's rows."""
    src, amap, chain = view(g, v)
    i, log = producer(g, src)
    if log is None or log.primitive.name != "log":
        return None
    inner, amap2, chain2 = view(g, _skip_abs(g, log.invars[0], covered))
    j, r = producer(g, inner)
    if r is None or r.primitive.name != "reduce_sum" or len(r.params["axes"]) != 1:
        return None
    k, ex = producer(g, r.invars[0])
    if ex is None or ex.primitive.name != "exp":
        return None
    amap = tuple(None if m is None else amap2[m] for m in amap)
    covered.update({i, j, k, *chain, *chain2})
    return ex.invars[0], int(r.params["axes"][0]), amap


def log_softmax_at(g: Graph, v):
    """``(logits, axis, covered)`` when ``v = s - log(sum_axis exp(s))`` with ``s = y -
    c`` (jax.nn.log_softmax; any shift ``c`` constant along the axis)."""
    covered: set = set()
    v = _through(g, v, covered)
    i, e = producer(g, v)
    if e is None or e.primitive.name != "sub":
        return None
    s, lg = e.invars
    trial = set()
    found = _log_sum_exp(g, lg, trial)
    if found is None or found[0] is not s:
        return None
    _, axis, amap = found
    rank = s.aval.ndim
    if not _rows_of(amap, axis, rank):
        return None
    j, d = producer(g, s)
    if d is None or d.primitive.name != "sub":
        return None
    shift = _row_shift(g, d.invars[1], axis, rank)
    if shift is None:
        return None
    covered.update(trial | {i, j, *shift[1]})
    is_row_max(g, shift[0], d.invars[0], axis, covered)  # the usual shift: covered too
    return d.invars[0], axis, frozenset(covered)


def _skip_abs(g: Graph, v, covered: set):
    """``|s|`` of a sum of exponentials is ``s`` (jax's logsumexp takes it for the sign)."""
    i, e = producer(g, v)
    if e is not None and e.primitive.name == "abs":
        covered.add(i)
        return e.invars[0]
    return v


def _row_axes(v, axis: int, rank: int) -> tuple | None:
    """The axis map of a row array ``v``: ``[rows]``, or ``[rows]`` with a unit at ``axis``."""
    if v.aval.ndim == rank - 1:
        return tuple(range(rank - 1))
    if v.aval.ndim == rank and v.aval.shape[axis] == 1:
        return tuple(None if a == axis else a - (a > axis) for a in range(rank))
    return None


def logsumexp_at(g: Graph, v, logits, axis: int, covered: set) -> bool:
    """Whether the row array ``v`` (``[rows]`` or with a unit class axis) is
    ``log(sum_axis exp(logits - c)) + c``."""
    i, e = producer(g, v)
    if e is None or e.primitive.name != "add":
        return False
    rank = logits.aval.ndim
    for lg, c in (e.invars, e.invars[::-1]):
        trial: set = set()
        found = _log_sum_exp(g, lg, trial)
        if found is None or found[1] != axis:
            continue
        s, _, amap = found
        if amap != _row_axes(v, axis, rank):
            continue
        j, sub = producer(g, s)
        if sub is None or sub.primitive.name != "sub" or sub.invars[0] is not logits:
            continue
        shift = _row_shift(g, sub.invars[1], axis, rank)
        if shift is None or shift[0] is not c:
            continue
        covered.update(trial | {i, j, *shift[1]})
        is_row_max(g, c, logits, axis, covered)  # the usual shift: covered too
        return True
    return False


# ---------------------------------------------------------------------- readouts
def _gathered(g: Graph, e):
    """``(logp, labels)`` when ``e`` gathers ``logp[..., labels[..., 0]]`` as ``[..., 1]``
    (a batched gather over every leading axis, penzai's indexing)."""
    if e.primitive.name != "gather":
        return None
    logp, idx = e.invars
    dn = e.params["dimension_numbers"]
    r = logp.aval.ndim
    lead = tuple(range(r - 1))
    ok = (
        tuple(dn.operand_batching_dims) == lead
        and tuple(dn.start_indices_batching_dims) == lead
        and tuple(dn.start_index_map) == (r - 1,)
        and tuple(dn.offset_dims) == (r - 1,)
        and tuple(dn.collapsed_slice_dims) == ()
        and tuple(e.params["slice_sizes"]) == (1,) * r
        and tuple(idx.aval.shape) == (*logp.aval.shape[:-1], 1)
    )
    return (logp, idx) if ok else None


def _one_hot_labels(g: Graph, v, rank: int, axis: int, covered: set):
    """The ``[rows]`` integer labels when ``v`` is ``float(labels[..., None] == iota)``
    along ``axis``."""
    i, cv = producer(g, v)
    if cv is None or cv.primitive.name != "convert_element_type":
        return None
    j, eq = producer(g, cv.invars[0])
    if eq is None or eq.primitive.name != "eq":
        return None
    for a, b in (eq.invars, eq.invars[::-1]):
        src, amap, chain = view(g, b)
        k, io = producer(g, src)
        if io is None or io.primitive.name != "iota" or len(amap) != rank:
            continue
        if io.params["dimension"] != amap[axis] or any(
            m is not None for x, m in enumerate(amap) if x != axis
        ):
            continue
        lab, lmap, lchain = view(g, a)
        rows = [x for x in range(rank) if x != axis]
        if not np.issubdtype(lab.aval.dtype, np.integer) or lmap[axis] is not None:
            continue
        if [lmap[x] for x in rows] != list(range(lab.aval.ndim)):
            continue
        covered.update({i, j, *chain, *lchain})
        if k is not None:
            covered.add(k)
        return lab
    return None


def _contracted(g: Graph, e, covered: set):
    """``(d, labels, axis)`` when ``e`` is ``sum_axis onehot(labels) * d`` per row."""
    if e.primitive.name != "dot_general" or not _plain_precision(e):
        return None
    lc, rc, lb, rb = _dims(e)
    a, b = e.invars
    rank = a.aval.ndim
    if len(lc) != 1 or lb != rb or lb != tuple(range(rank - 1)) or lc != rc:
        return None
    if b.aval.ndim != rank or lc[0] != rank - 1:
        return None
    for oh, d in ((a, b), (b, a)):
        labels = _one_hot_labels(g, oh, rank, rank - 1, covered)
        if labels is not None:
            return d, labels, rank - 1
    return None


# ---------------------------------------------------------------------- logits
def _logits_source(g: Graph, z, covered: set):
    """``(z, cap)``: the logits before an optional ``cap * tanh(z / cap)``."""
    z = _through(g, z, covered)
    i, e = producer(g, z)
    if e is not None and e.primitive.name == "mul":
        cap = soft_cap(g, e, covered)
        if cap is not None:
            covered.add(i)
            return _through(g, cap[1], covered), cap[0]
    return z, None


@dataclasses.dataclass(frozen=True)
class Head:
    """Logits ``(x @ w)[..., rows, :]``: the head product, maybe sliced along positions."""

    x: Any
    w: Any
    transposed: bool  # w is [V, D]
    starts: tuple | None  # the slice of x's leading axes (transformers' logits[:, :-1])
    limits: tuple | None

    def rows(self, x):
        if self.starts is None:
            return x
        return x[tuple(slice(s, t) for s, t in zip(self.starts, self.limits))]

    def weight(self, w):
        return w.T if self.transposed else w


def head(g: Graph, z, covered: set) -> Head | None:
    """The head when the logits ``z`` are ``(x @ w)[slices]`` with the classes unsliced."""
    chain: set = set()
    i, e = producer(g, z)
    if e is not None and is_upcast(e):  # bfloat16 logits upcast for the loss
        chain.add(i)
        z = e.invars[0]
        i, e = producer(g, z)
    starts = limits = None
    if e is not None and e.primitive.name == "slice" and e.params.get("strides") is None:
        st, lim, src = e.params["start_indices"], e.params["limit_indices"], e.invars[0]
        if st[-1] == 0 and lim[-1] == src.aval.shape[-1]:
            starts, limits = tuple(st[:-1]), tuple(lim[:-1])
            chain.add(i)
            z = _through(g, src, chain)
    lin = linear_at(g, z)
    if lin is None or lin.w.aval.ndim != 2 or lin.k != 1:
        return None
    covered.update(chain | lin.covered)
    return Head(lin.x, lin.w, lin.transposed, starts, limits)


# ---------------------------------------------------------------------- the finder
def find_cross_entropy(g: Graph, i: int):
    """A per-row cross-entropy read out at equation ``i`` (a gather or a contraction)."""
    from cannjax._src.optimization.rewrite import Replacement

    e = g.jaxpr.eqns[i]
    covered = {i}
    got = _gathered(g, e)
    if got is not None:
        logp, idx = got
        sm = log_softmax_at(g, logp)
        if sm is None or sm[1] != logp.aval.ndim - 1:
            return None
        z, _, sm_cov = sm
        covered |= sm_cov
        labels, sign, keep_dim, readout = idx, -1.0, True, "log_softmax[label]"
    else:
        got = _contracted(g, e, covered)
        if got is None:
            return None
        d, labels, axis = got
        j, sub = producer(g, d)
        if sub is None or sub.primitive.name != "sub":
            return None
        covered.add(j)
        a, b = sub.invars
        ha = view(g, a)
        if len(ha[1]) == a.aval.ndim and ha[1][axis] is None:  # lse - z
            lse_b, z, sign = a, b, 1.0
        else:  # z - lse
            z, lse_b, sign = a, b, -1.0
        shift = _row_shift(g, lse_b, axis, z.aval.ndim)
        if shift is None or not logsumexp_at(g, shift[0], z, axis, covered):
            return None
        covered.update(shift[1])
        keep_dim, readout = False, "one-hot . (logsumexp - logits)"
    classes = z.aval.shape[-1]
    logits, cap = _logits_source(g, z, covered)
    hd = head(g, logits, covered)
    out = e.outvars[0]

    def finish(loss, labels):
        if not keep_dim:  # the one-hot reads nothing for a label outside [0, V)
            loss = jnp.where((labels >= 0) & (labels < classes), loss, 0.0)
        return (sign * loss)[..., None] if keep_dim else sign * loss

    if hd is not None:

        def call(xv, wv, lab):
            lab = lab[..., 0] if keep_dim else lab
            loss = ops.linear_cross_entropy(
                hd.rows(xv), hd.weight(wv), _clip(lab, classes), logit_cap=cap
            )
            return finish(loss.astype(out.aval.dtype), lab)

        inputs, op = (hd.x, hd.w, labels), "linear_cross_entropy"
    else:

        def call(zv, lab):
            lab = lab[..., 0] if keep_dim else lab
            loss = ops.softmax_cross_entropy(zv, _clip(lab, classes), logit_cap=cap)
            return finish(loss.astype(out.aval.dtype), lab)

        inputs, op = (logits, labels), "softmax_cross_entropy"
    source = f"{readout} (structural)" + (", soft-capped" if cap is not None else "")
    if hd is not None:
        source += " of x @ w"
    return Replacement("loss", op, source, inputs, frozenset(covered), out, call)


def _clip(labels, classes: int):
    """Labels in ``[0, V)``; the rows of others are zeroed by the caller or clipped as a
    gather clips them."""
    return jnp.clip(labels, 0, classes - 1)
