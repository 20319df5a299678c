"""Cross-entropy found by meaning: ``log softmax(logits)[label]`` however it is read out.

A template of :mod:`idioms` covers optax's integer-label loss. The other spellings are
read here: penzai indexes ``log_softmax`` with a batched ``gather`` (labels wrapped into
``[0, V)`` first), haliax contracts the one-hot labels with ``logsumexp(logits) - logits``
in one ``dot_general``, optax's ``softmax_cross_entropy`` sums ``targets *
log_softmax(logits)`` with targets ``a * one_hot(labels) + b`` (``jax.nn.one_hot``,
``optax.smooth_labels``, flax's ``onehot(on_value, off_value)``: label smoothing), and a
per-row ``w * logsumexp(logits)^2`` added to it is PaLM's z-loss. The finder then walks
the logits back through an optional soft cap ``c * tanh(z / c)`` (Gemma 2's final
logits), an optional slice of positions (``logits[:, :-1]``), to a head product ``x @
w``: with one, the loss is :func:`cannjax.ops.linear_cross_entropy` and the ``[N, V]``
logits are never held whole.

Every readout is a proof of the per-row value ``-log p[label] = logsumexp(z) - z[label]``
(times a constant, plus ``eps`` times the smoothing term):

- ``log_softmax`` and ``logsumexp`` are accepted as ``y - c - log(sum exp(y - c))`` and
  ``log(sum exp(y - c)) + c`` for any ``c`` constant along the class axis (it cancels);
- the one-hot is ``labels[..., None] == iota`` along the class axis, so a label outside
  ``[0, V)`` reads nothing: the replacement reads it the same way (no class picked);
- ``sum_c T_c (lse - z_c)`` with ``T = a one_hot + b`` is ``k CE_eps`` with ``k = a + b
  V`` and ``eps = b V / k`` (:func:`_read_targets`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore

from cannjax import ops
from cannjax._src.core import jaxpr as J
from cannjax._src.core.graph import (
    Graph,
    constant_value,
    is_upcast,
    producer,
    scalar,
    skip_identities,
    squared,
    uniform,
    view,
)
from cannjax._src.ops.linear_cross_entropy import one_hot_linear_cross_entropy
from cannjax._src.ops.losses import one_hot_cross_entropy
from cannjax._src.optimization import idioms
from cannjax._src.optimization.finders.dense import _dims, _plain_precision, linear_at, promoted
from cannjax._src.optimization.finders.logit_forms import is_row_max, soft_cap
from cannjax._src.optimization.replacement import Kind, Miss, Replacement
from cannjax._src.optimization.templates import IdiomMatch, match_idiom


def _rows_of(amap, axis: int, rank: int) -> bool:
    """Whether ``amap`` reads a ``[rows]`` array: the class ``axis`` broadcast, the other
    axes in order."""
    rows = [a for a in range(rank) if a != axis]
    return (
        len(amap) == rank
        and amap[axis] is None
        and [amap[a] for a in rows] == list(range(rank - 1))
    )


def row_shift(g: Graph, c, axis: int, rank: int):
    """``(source, chain)`` when ``c`` is a ``[rows]`` array broadcast along ``axis``."""
    src, amap, chain = view(g, c, moves=True)
    if not isinstance(src, jcore.Var) or not _rows_of(amap, axis, rank):
        return None
    return src, chain


def _log_sum_exp(g: Graph, v, covered: set):
    """``(s, axis, amap)`` when ``v`` (through views) is ``log(sum_axis exp(s))``, the sum
    kept as a unit axis or not, ``|.|`` taken or not; ``amap`` maps ``v``'s axes to the
    sum's rows."""
    src, amap, chain = view(g, v, moves=True)
    i, log = producer(g, src)
    if log is None or log.primitive.name != "log":
        return None
    arg = _rounded(g, log.invars[0], covered)
    inner, amap2, chain2 = view(g, _skip_abs(g, arg, covered), moves=True)
    j, r = producer(g, _rounded(g, inner, covered))
    if r is None or r.primitive.name != "reduce_sum" or len(r.params["axes"]) != 1:
        return None
    k, ex = producer(g, _rounded(g, r.invars[0], covered))
    if ex is None or ex.primitive.name != "exp":
        return None
    amap = tuple(None if m is None else amap2[m] for m in amap)
    covered.update({i, j, k, *chain, *chain2})
    return ex.invars[0], int(r.params["axes"][0]), amap


def _rounded(g: Graph, v, covered: set):
    """The value ``v`` converts, through float-to-float converts (``jax.nn.log_softmax``
    of half logits sums ``exp`` in float32 and rounds the sum back to half: the operator
    drops that rounding); their indices go to ``covered``."""
    while True:
        i, e = producer(g, v)
        if e is None or e.primitive.name != "convert_element_type":
            return v
        src = e.invars[0]
        if not (isinstance(src, jcore.Var) and J.is_float(src.aval.dtype)):
            return v
        if not J.is_float(v.aval.dtype):
            return v
        covered.add(i)
        v = src


def log_softmax_at(g: Graph, v):
    """``(logits, axis, covered)`` when ``v = s - log(sum_axis exp(s))`` with ``s = y -
    c`` (jax.nn.log_softmax; any shift ``c`` constant along the axis)."""
    covered: set = set()
    v = skip_identities(g, v, covered, unit_products=True)
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
    shift = row_shift(g, d.invars[1], axis, rank)
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


def _same_rows(g: Graph, c, rows, axis: int, rank: int) -> bool:
    """Whether the row array ``c`` is ``rows`` itself or ``rows`` through unit views."""
    if c is rows:
        return True
    src, amap, _ = view(g, c, moves=True)
    return src is rows and amap == _row_axes(c, axis, rank)


def logsumexp_at(g: Graph, v, logits, axis: int, covered: set) -> bool:
    """Whether the row array ``v`` (``[rows]`` or with a unit class axis) is
    ``log(sum_axis exp(logits - c)) + c`` or ``log(sum_axis exp(logits))``."""
    rank = logits.aval.ndim
    trial: set = set()
    found = _log_sum_exp(g, v, trial)
    if found is not None and found[0] is logits and found[1] == axis:
        if found[2] == _row_axes(v, axis, rank):  # unshifted: exp may overflow, as written
            covered.update(trial)
            return True
    i, e = producer(g, v)
    if e is None or e.primitive.name != "add":
        return False
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
        shift = row_shift(g, sub.invars[1], axis, rank)
        if shift is None or not _same_rows(g, c, shift[0], axis, rank):
            continue
        covered.update(trial | {i, j, *shift[1], *view(g, c, moves=True)[2]})
        is_row_max(g, shift[0], logits, axis, covered)  # the usual shift: covered too
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


def _eq_labels(g: Graph, eq, rank: int, axis: int, covered: set):
    """The ``[rows]`` integer labels when the equation ``eq`` is ``labels[..., None] ==
    iota`` along ``axis``."""
    if eq.primitive.name != "eq":
        return None
    for a, b in (eq.invars, eq.invars[::-1]):
        src, amap, chain = view(g, b, moves=True)
        k, io = producer(g, src)
        if io is None or io.primitive.name != "iota" or len(amap) != rank:
            continue
        if io.params["dimension"] != amap[axis] or any(
            m is not None for x, m in enumerate(amap) if x != axis
        ):
            continue
        lab, lmap, lchain = view(g, a, moves=True)
        rows = [x for x in range(rank) if x != axis]
        if not np.issubdtype(lab.aval.dtype, np.integer) or lmap[axis] is not None:
            continue
        if [lmap[x] for x in rows] != list(range(lab.aval.ndim)):
            continue
        covered.update({*chain, *lchain, k} - {None})
        return lab
    return None


@dataclasses.dataclass(frozen=True)
class Targets:
    """``a * one_hot(labels) + b`` along the class axis (``a``, ``b`` constants): optax's
    ``smooth_labels(one_hot(labels), eps)`` has ``a = 1 - eps``, ``b = eps / V``; flax's
    ``onehot(labels, V, on_value, off_value)`` has ``a = on - off``, ``b = off``."""

    labels: Any
    a: float
    b: float


def targets(g: Graph, v, rank: int, axis: int, covered: set) -> Targets | None:
    """``v`` as :class:`Targets`, read from the outside in: ``v = A * inner + B`` through
    products, sums and differences with constants."""
    A, B, chain = 1.0, 0.0, set()
    while True:
        v = skip_identities(g, v, chain)
        i, e = producer(g, v)
        if e is None:
            return None
        chain.add(i)
        name = e.primitive.name
        if name == "convert_element_type":  # bool -> float: the one-hot itself
            j, eq = producer(g, e.invars[0])
            labels = None if eq is None else _eq_labels(g, eq, rank, axis, chain)
            if labels is None:
                return None
            covered.update(chain | {j})
            return Targets(labels, A, B)
        if name == "select_n" and len(e.invars) == 3:  # where(one-hot, on, off)
            j, eq = producer(g, e.invars[0])
            off, on = uniform(g, e.invars[1]), uniform(g, e.invars[2])
            labels = None if eq is None else _eq_labels(g, eq, rank, axis, chain)
            if labels is None or off is None or on is None:
                return None
            covered.update(chain | {j})
            return Targets(labels, A * (on - off), B + A * off)
        if name not in ("mul", "add", "sub") or len(e.invars) != 2:
            return None
        x, y = e.invars
        c, minus = uniform(g, y), False  # v = x op c
        if c is None:  # v = c op x
            x, c, minus = y, uniform(g, x), name == "sub"
        if c is None or x.aval.shape != v.aval.shape:
            return None
        if name == "mul":
            A *= c
        elif minus:  # c - x
            B, A = B + A * c, -A
        else:
            B += A * (c if name == "add" else -c)
        v = x


@dataclasses.dataclass(frozen=True)
class ClassTerms:
    """``d = sign * (logsumexp(z) - z)`` along the class axis; ``flat``: the row shape
    ``d`` has when ``log_softmax(z)`` was reshaped to it, the classes kept (``lp.reshape(-1,
    V)``), else None."""

    z: Any
    sign: float
    flat: tuple | None = None


def _regroups_rows(e, d) -> bool:
    """Whether the equation ``e`` making ``d`` is a reshape that only regroups the rows,
    the last (class) axis kept (``lp.reshape(-1, V)``)."""
    if e is None or e.primitive.name != "reshape" or e.params.get("dimensions") is not None:
        return False
    src = e.invars[0]
    return (
        isinstance(src, jcore.Var) and src.aval.ndim >= 1 and src.aval.shape[-1] == d.aval.shape[-1]
    )


def _class_terms(g: Graph, d, axis: int, covered: set) -> ClassTerms | None:
    """The :class:`ClassTerms` when ``d = sign * (logsumexp(z) - z)`` along ``axis``:
    ``log_softmax(z)`` (sign -1), ``lse - z`` (+1) or ``z - lse`` (-1), maybe negated, maybe
    with its rows regrouped, maybe upcast (optax's loss of half logits: a bfloat16
    ``log_softmax`` read in float32)."""
    sign, chain = 1.0, set()
    while True:
        i, e = producer(g, d)
        if e is not None and is_upcast(e) and isinstance(e.invars[0], jcore.Var):
            d = e.invars[0]
        elif e is not None and e.primitive.name == "neg":
            sign, d = -sign, e.invars[0]
        else:
            break
        chain.add(i)
    rank = d.aval.ndim
    sm = log_softmax_at(g, d)
    if sm is not None:
        if sm[1] != axis:
            return None
        covered.update(chain | sm[2])
        return ClassTerms(sm[0], -sign)
    i, e = producer(g, d)
    if axis == rank - 1 and _regroups_rows(e, d):
        trial: set = set()
        src = e.invars[0]
        inner = _class_terms(g, src, src.aval.ndim - 1, trial)
        if inner is None or inner.flat is not None:
            return None
        covered.update(chain | trial | {i})
        return ClassTerms(inner.z, sign * inner.sign, tuple(d.aval.shape[:-1]))
    j, sub = producer(g, d)
    if sub is None or sub.primitive.name != "sub":
        return None
    a, b = sub.invars
    ha = view(g, a, moves=True)
    if len(ha[1]) == rank and ha[1][axis] is None:  # lse - z
        lse_b, z = a, b
    else:  # z - lse
        z, lse_b, sign = a, b, -sign
    trial = set(chain | {j})
    shift = row_shift(g, lse_b, axis, rank)
    if shift is None or not logsumexp_at(g, shift[0], z, axis, trial):
        return None
    covered.update(trial | set(shift[1]))
    return ClassTerms(z, sign)


def _summed(g: Graph, e, covered: set):
    """``(terms, targets)`` read out by ``e``: ``sum_axis targets * terms`` as one
    ``dot_general`` (haliax) or ``reduce_sum`` of a product (optax), the class axis last."""
    if e.primitive.name == "dot_general" and _plain_precision(e):
        lc, rc, lb, rb = _dims(e)
        a, b = e.invars
        rank = a.aval.ndim
        if lc != (rank - 1,) or lc != rc or lb != rb or lb != tuple(range(rank - 1)):
            return None
        if b.aval.ndim != rank:
            return None
        pairs = ((a, b), (b, a))
    elif e.primitive.name == "reduce_sum" and len(e.invars) == 1:
        rank = e.invars[0].aval.ndim
        if tuple(e.params["axes"]) != (rank - 1,):
            return None
        i, m = producer(g, e.invars[0])
        if m is None or m.primitive.name != "mul":
            return None
        covered.add(i)
        pairs = (tuple(m.invars), tuple(m.invars[::-1]))
    else:
        return None
    for t, d in pairs:
        if t.aval.shape != d.aval.shape:
            continue
        found = targets(g, t, rank, rank - 1, covered)
        if found is not None:
            return d, found
    return None


# ---------------------------------------------------------------------- logits
def _logits_source(g: Graph, z, covered: set):
    """``(z, cap)``: the logits before an optional ``cap * tanh(z / cap)``."""
    z = skip_identities(g, z, covered, unit_products=True)
    i, e = producer(g, z)
    if e is not None and e.primitive.name == "mul":
        cap = soft_cap(g, e, covered)
        if cap is not None:
            covered.add(i)
            return skip_identities(g, cap[1], covered, unit_products=True), cap[0]
    return z, None


@dataclasses.dataclass(frozen=True)
class Head:
    """Logits ``(x @ w)[..., rows, :]``: the head product, maybe sliced along positions,
    maybe with its row axes then flattened (``logits.reshape(-1, V)``)."""

    x: Any
    w: Any
    transposed: bool  # w is [V, D]
    starts: tuple | None  # the slice of x's leading axes (transformers' logits[:, :-1])
    limits: tuple | None
    flat: tuple | None = None  # the row axes' shape after a reshape
    dtype: Any = None  # the product's dtype where it promotes one operand (dense.Linear)

    def rows(self, x):
        if self.starts is not None:
            x = x[tuple(slice(s, t) for s, t in zip(self.starts, self.limits))]
        return x if self.flat is None else x.reshape(*self.flat, x.shape[-1])

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
    flat = None
    if e is not None and e.primitive.name == "reshape" and e.params.get("dimensions") is None:
        src = e.invars[0]
        if src.aval.shape[-1] == z.aval.shape[-1]:  # rows regrouped, the classes kept
            flat = tuple(z.aval.shape[:-1])
            chain.add(i)
            z = skip_identities(g, src, chain, unit_products=True)
            i, e = producer(g, z)
    starts = limits = None
    if e is not None and e.primitive.name == "slice" and e.params.get("strides") is None:
        st, lim, src = e.params["start_indices"], e.params["limit_indices"], e.invars[0]
        if st[-1] == 0 and lim[-1] == src.aval.shape[-1]:
            starts, limits = tuple(st[:-1]), tuple(lim[:-1])
            chain.add(i)
            z = skip_identities(g, src, chain, unit_products=True)
    lin = linear_at(g, z)
    if lin is None or lin.w.aval.ndim != 2 or lin.k != 1:
        return None
    covered.update(chain | lin.covered)
    return Head(lin.x, lin.w, lin.transposed, starts, limits, flat, lin.dtype)


# ---------------------------------------------------------------------- the finders
class Reading(enum.StrEnum):
    """How a label reads its class (see :class:`CrossEntropy`)."""

    ONE_HOT = "one-hot"
    INDEX = "index"
    CLIPPED = "clipped"
    NUMPY = "numpy"


@dataclasses.dataclass(frozen=True)
class CrossEntropy:
    """A per-row cross-entropy found in the program:
    ``out = factor * (CE_eps(z, labels) + z_loss * logsumexp(z)^2)``.

    Attributes:
      z: the logits the softmax reads (a soft cap and the head are walked later).
      labels: the integer labels as the program holds them.
      reading: how a label reads its class: ``"one-hot"`` (a label outside ``[0, V)``
        picks nothing, as ``jax.nn.one_hot``), ``"index"`` (optax's integer labels:
        ``[-V, 0)`` counts from the end, others give NaN), ``"clipped"`` (a gather that
        clips), ``"numpy"`` (numpy-style indexing: ``[-V, 0)`` from the end, then
        clamped).
      keep_dim: the loss is ``[..., 1]`` (a gathered ``log_softmax``).
      unit_labels: the labels are ``[..., 1]`` (``take_along_axis``'s indices).
      factor: the sign and scale of the readout.
      smoothing: ``eps`` of the targets ``(1 - eps) one_hot + eps / V``.
      z_loss: the weight of ``logsumexp(z)^2``, relative to ``factor``.
      structural: found by reading the program (else by a template of :mod:`idioms`).
      flat: the row shape the log-probabilities were reshaped to (``z``'s rows
        regrouped, its classes kept), or None.
    """

    z: Any
    labels: Any
    reading: Reading
    covered: frozenset
    out: Any
    source: str
    keep_dim: bool = False
    unit_labels: bool = False
    factor: float = 1.0
    smoothing: float = 0.0
    z_loss: float = 0.0
    structural: bool = True  # found by reading the program, not by a template
    flat: tuple | None = None


_NOT_SMOOTHED = Miss(
    "cross-entropy (sum of targets * -log_softmax) but the targets a * one_hot + b have "
    "a <= 0 or b < 0 (not a one-hot with label smoothing)"
)


def _read_targets(z, labels: Targets, sign: float, e, covered, source):
    """The :class:`CrossEntropy` of ``sum_c T_c * sign (lse - z_c)`` with ``T = a one_hot
    + b``: ``sign k CE_eps`` with ``k = a + b V`` and ``eps = b V / k``, since
    ``sum_c T_c (lse - z_c) = a (lse - z_y) + b sum_c (lse - z_c)``."""
    a, b, V = labels.a, labels.b, z.aval.shape[-1]
    if a < 0 and b <= 0:
        a, b, sign = -a, -b, -sign
    if not (a > 0 and b >= 0):
        return _NOT_SMOOTHED
    k = a + b * V
    return CrossEntropy(
        z,
        labels.labels,
        Reading.ONE_HOT,
        frozenset(covered),
        e.outvars[0],
        source,
        factor=sign * k,
        smoothing=b * V / k,
    )


def _take_along(g: Graph, v, covered: set):
    """``(z, labels, unit)`` when ``v`` is ``take_along_axis(z, labels[..., None], -1)``
    with the unit axis squeezed or not: the wrap ``labels < 0 ? labels + V : labels``,
    then a batched gather that fills NaN outside ``[0, V)`` (``unit``: the labels the
    program holds are ``[..., 1]``)."""
    src, amap, chain = view(g, v, moves=True)
    i, e = producer(g, src)
    if e is None or e.primitive.name != "gather" or len(e.invars) != 2:
        return None
    z, idx = e.invars
    r = z.aval.ndim
    if amap not in (tuple(range(r - 1)), (*range(r - 1), None)):  # squeezed or not
        return None
    dn = e.params["dimension_numbers"]
    lead = tuple(range(r - 1))
    mode = str(e.params["mode"])
    ok = (
        tuple(dn.operand_batching_dims) == lead
        and tuple(dn.start_indices_batching_dims) == lead
        and tuple(dn.start_index_map) == (r - 1,)
        and tuple(dn.collapsed_slice_dims) == (r - 1,)
        and tuple(dn.offset_dims) == ()
        and tuple(e.params["slice_sizes"]) == (1,) * r
        and "FILL_OR_DROP" in mode
        and tuple(e.outvars[0].aval.shape) == (*z.aval.shape[:-1], 1)
    )
    if not ok:
        return None
    wrapped, _, ichain = view(g, idx, moves=True)
    lab = _unwrapped(g, wrapped, z.aval.shape[-1], covered)
    if lab is None:
        return None
    labels, lmap, lchain = view(g, lab, moves=True)
    unit = lmap != tuple(range(lab.aval.ndim - 1)) + (None,) or labels.aval.ndim != r - 1
    if unit:
        labels, lchain = lab, []
    covered.update({i, *chain, *ichain, *lchain})
    return z, labels, unit


def _unwrapped(g: Graph, v, classes: int, covered: set):
    """``labels`` when ``v = where(labels < 0, labels + classes, labels)`` (numpy's
    negative indices, as jax's indexing wraps them)."""
    j, sel = producer(g, v)
    if sel is None or sel.primitive.name != "select_n" or len(sel.invars) != 3:
        return None
    pred, lab, shifted = sel.invars
    k, lt = producer(g, pred)
    m, add = producer(g, shifted)
    if lt is None or lt.primitive.name != "lt" or lt.invars[0] is not lab:
        return None
    if scalar(g, lt.invars[1]) != 0 or add is None or add.primitive.name != "add":
        return None
    if add.invars[0] is not lab or scalar(g, add.invars[1]) != classes:
        return None
    covered.update({j, k, m})
    return lab


def _indexed(g: Graph, e, covered: set):
    """``(logp, labels)`` when ``e`` is numpy-style indexing ``logp[i0, i1, .., labels]``
    with ``i_k`` the positions along each row axis (``jnp.arange(N)`` broadcast): a gather
    of every axis at concatenated indices, which wraps negative labels and clamps."""
    if e.primitive.name != "gather" or len(e.invars) != 2:
        return None
    logp, idx = e.invars
    r = logp.aval.ndim
    dn = e.params["dimension_numbers"]
    ok = (
        tuple(dn.offset_dims) == ()
        and tuple(dn.collapsed_slice_dims) == tuple(range(r))
        and tuple(dn.start_index_map) == tuple(range(r))
        and tuple(dn.operand_batching_dims) == ()
        and tuple(e.params["slice_sizes"]) == (1,) * r
        and str(e.params["mode"]).rsplit(".", 1)[-1] in ("CLIP", "PROMISE_IN_BOUNDS")
        and tuple(e.outvars[0].aval.shape) == tuple(logp.aval.shape[:-1])
    )
    i, cat = producer(g, idx)
    if not ok or cat is None or cat.primitive.name != "concatenate" or len(cat.invars) != r:
        return None
    rows = tuple(logp.aval.shape[:-1])
    if cat.params["dimension"] != r - 1 or tuple(idx.aval.shape) != (*rows, r):
        return None
    for k, part in enumerate(cat.invars[:-1]):  # the row positions: constants
        value = constant_value(g, part)
        want = np.arange(rows[k]).reshape([-1 if a == k else 1 for a in range(r - 1)])
        if value is None or not np.array_equal(value[..., 0], np.broadcast_to(want, rows)):
            return None
    trial = {i}
    wrapped, wmap, wchain = view(g, cat.invars[-1], moves=True)
    lab = _unwrapped(g, wrapped, logp.aval.shape[-1], trial)
    if lab is None or wmap != (*range(r - 1), None) or lab.aval.ndim != r - 1:
        return None
    covered.update(trial | set(wchain))
    return logp, lab


def _lse_minus_label(g: Graph, e, covered: set):
    """The :class:`CrossEntropy` when ``e`` is ``logsumexp(z) - z[label]`` (or its
    negation), the label's logit read by ``take_along_axis`` or as ``sum(targets * z)``
    with targets summing to 1 (``one_hot``, smoothed or not). The logsumexp may be
    of ``z`` shifted by a row constant (optax: ``z - max`` in both terms)."""
    if e.primitive.name != "sub" or e.outvars[0].aval.ndim == 0:
        return None
    for lse, pick, sign in ((*e.invars, 1.0), (*e.invars[::-1], -1.0)):
        trial = set(covered)
        got = _take_along(g, pick, trial)
        if got is not None:
            z, labels, unit = got
            found = None
        else:
            j, s = producer(g, pick)
            got = None if s is None else _summed(g, s, trial)
            if got is None:
                continue
            trial.add(j)
            z, found = got
            if abs(found.a + found.b * z.aval.shape[-1] - 1.0) > 1e-6:
                continue  # sum(T z) is k z_y + ...: lse must be k lse
        axis = z.aval.ndim - 1
        if tuple(lse.aval.shape) != tuple(z.aval.shape[:-1]):
            continue
        if not logsumexp_at(g, lse, z, axis, trial):
            continue
        if found is None:
            return CrossEntropy(
                z, labels, Reading.INDEX, frozenset(trial), e.outvars[0],
                "logsumexp - take_along_axis(logits, label)", unit_labels=unit, factor=sign,
            )  # fmt: skip
        source = "logsumexp - sum(targets * logits)"
        if (found.a, found.b) != (1.0, 0.0):
            source += ", label-smoothed"
        V = z.aval.shape[-1]
        return CrossEntropy(
            z, found.labels, Reading.ONE_HOT, frozenset(trial), e.outvars[0], source,
            factor=sign, smoothing=found.b * V,
        )  # fmt: skip
    return None


def describe(g: Graph, i: int) -> CrossEntropy | Miss | None:
    """The cross-entropy read out at equation ``i`` by a gather of ``log_softmax``, a
    contraction or a sum of targets times ``-log_softmax``; a :class:`Miss` for a near
    miss; else None."""
    e = g.jaxpr.eqns[i]
    covered = {i}
    took = None if e.primitive.name != "gather" else _take_along(g, e.outvars[0], covered)
    if took is not None:  # take_along_axis(log_softmax(z), labels[..., None])
        logp, labels, unit = took
        terms = _class_terms(g, logp, logp.aval.ndim - 1, covered)
        if terms is None:
            return None
        return CrossEntropy(
            terms.z, labels, Reading.INDEX, frozenset(covered), e.outvars[0],
            "take_along_axis(log_softmax, label)", keep_dim=True, unit_labels=unit,
            factor=terms.sign, flat=terms.flat,
        )  # fmt: skip
    indexed = _indexed(g, e, covered)
    if indexed is not None:  # log_softmax(z)[jnp.arange(N), labels]
        logp, labels = indexed
        terms = _class_terms(g, logp, logp.aval.ndim - 1, covered)
        if terms is None:
            return None
        return CrossEntropy(
            terms.z, labels, Reading.NUMPY, frozenset(covered), e.outvars[0],
            "log_softmax[arange, label]", factor=terms.sign, flat=terms.flat,
        )  # fmt: skip
    got = _gathered(g, e)
    if got is not None:
        logp, idx = got
        sm = log_softmax_at(g, logp)
        if sm is None or sm[1] != logp.aval.ndim - 1:
            return None
        z, _, sm_cov = sm
        covered |= sm_cov
        return CrossEntropy(
            z, idx, Reading.CLIPPED, frozenset(covered), e.outvars[0], "log_softmax[label]",
            keep_dim=True, unit_labels=True, factor=-1.0,
        )  # fmt: skip
    picked = _lse_minus_label(g, e, covered)
    if picked is not None:
        return picked
    got = _summed(g, e, covered)
    if got is None:
        return None
    d, found = got
    terms = _class_terms(g, d, d.aval.ndim - 1, covered)
    if terms is None:
        return None
    readout = (
        "one-hot . (logsumexp - logits)"
        if e.primitive.name == "dot_general"
        else ("sum(targets * log_softmax)")
    )
    if (found.a, found.b) != (1.0, 0.0):
        readout += ", label-smoothed"
    ce = _read_targets(terms.z, found, terms.sign, e, covered, readout)
    return dataclasses.replace(ce, flat=terms.flat) if isinstance(ce, CrossEntropy) else ce


def _from_template(g: Graph, i: int) -> CrossEntropy | None:
    """optax's integer-label loss, or ``take_along_axis(log_softmax)``, by template."""

    for idiom in idioms.LOSSES:
        found = match_idiom(g, i, idiom)
        if isinstance(found, IdiomMatch):
            cand, m = found.candidate, found.match
            gathered = idiom.anchors == frozenset({"gather"})
            z, labels = m.inputs
            return CrossEntropy(
                z, labels, Reading.INDEX, m.covered, g.jaxpr.eqns[i].outvars[0], cand.source,
                keep_dim=gathered, unit_labels=gathered, factor=-1.0 if gathered else 1.0,
                structural=False,
            )  # fmt: skip
    return None


def _z_term(g: Graph, v, covered: set):
    """``(weight, l)`` when ``v = weight * l^2`` (``weight`` a constant, 1 if absent)."""
    chain, weight = set(), 1.0
    i, e = producer(g, v)
    if e is not None and e.primitive.name == "mul":
        for x, y in (e.invars, e.invars[::-1]):
            c = scalar(g, y)
            if c is not None:
                weight, v = c, x
                chain.add(i)
                break
    base = squared(g, v)
    if base is None:
        return None
    covered.update(chain | {g.producer[v][0]})
    return weight, base


def _scaled(g: Graph, e):
    """``(c, r)`` when the equation ``e`` makes ``c * r``: ``-r``, ``0 - r``, ``c * r``
    or ``r * c`` with ``c`` a 0-d constant."""
    name = e.primitive.name
    if name == "neg":
        return -1.0, e.invars[0]
    if name == "sub" and scalar(g, e.invars[0]) == 0.0:
        return -1.0, e.invars[1]
    if name == "mul":
        for c, r in (e.invars, e.invars[::-1]):
            k = scalar(g, c)
            if k is not None and isinstance(r, jcore.Var) and k != 0:
                return k, r
    return None


def _reshapes(e) -> bool:
    """A reshape or squeeze that keeps the elements in order (rows regrouped, a unit
    class axis dropped): the per-row loss it reads, reshaped, is the value it makes."""
    if e.primitive.name == "squeeze":
        return True
    return e.primitive.name == "reshape" and e.params.get("dimensions") is None


def _cross_entropy_of(g: Graph, v):
    """The :class:`CrossEntropy` whose output is ``v``, through negations and reshapes
    of the per-row loss (``[rows, 1] -> [rows]``, ``[N] -> [B, T]``)."""
    sign, chain, out = 1.0, set(), v
    while True:
        i, e = producer(g, v)
        if e is None:
            return None
        scaled = _scaled(g, e)
        if scaled is not None:  # -r, 0 - r, c * r
            sign, v = sign * scaled[0], scaled[1]
        elif _reshapes(e) and isinstance(e.invars[0], jcore.Var):
            v = e.invars[0]
        else:
            break
        chain.add(i)
    ce = describe(g, i)
    if not isinstance(ce, CrossEntropy):
        ce = _from_template(g, i)
    if ce is None:
        return None
    return dataclasses.replace(
        ce, factor=sign * ce.factor, covered=ce.covered | chain, out=out, keep_dim=False
    )


def find_z_loss(g: Graph, i: int):
    """``CE + w * logsumexp(z)^2`` per row (PaLM's z-loss, as t5x and levanter add it)."""
    e = g.jaxpr.eqns[i]
    if e.primitive.name != "add" or e.outvars[0].aval.ndim == 0:
        return None
    for ce_side, z_side in (e.invars, e.invars[::-1]):
        covered = {i}
        term = _z_term(g, z_side, covered)
        if term is None or not isinstance(ce_side, jcore.Var):
            continue
        ce = _cross_entropy_of(g, ce_side)
        if ce is None or ce.keep_dim or ce.factor <= 0 or ce_side.aval.shape != z_side.aval.shape:
            continue
        weight, lse = term
        if not weight >= 0 or not logsumexp_at(g, lse, ce.z, ce.z.aval.ndim - 1, covered):
            continue
        ce = dataclasses.replace(
            ce,
            covered=ce.covered | covered,
            out=e.outvars[0],
            source=ce.source + " + z-loss",
            z_loss=weight / ce.factor,
        )
        return replacement(g, ce)
    return None


def find_cross_entropy(g: Graph, i: int):
    """A per-row cross-entropy read out at equation ``i`` (:func:`describe`)."""
    ce = describe(g, i)
    return replacement(g, ce) if isinstance(ce, CrossEntropy) else ce


def find_template_loss(g: Graph, i: int):
    """optax's integer-label loss (a template), fused with its head like the others."""
    ce = _from_template(g, i)
    return None if ce is None else replacement(g, ce)


def replacement(g: Graph, ce: CrossEntropy):
    """The :class:`Replacement` computing ``ce``: of logits ``x @ w`` (through a soft cap,
    an upcast, a slice of positions) ``linear_cross_entropy``, else
    ``softmax_cross_entropy``, each in the label reading of ``ce``."""

    covered = set(ce.covered)
    classes = ce.z.aval.shape[-1]
    logits, cap = _logits_source(g, ce.z, covered)
    if not g.private(covered, [ce.out]):  # the capped logits are read elsewhere too
        logits, cap, covered = ce.z, None, set(ce.covered)
    with_head = set(covered)
    hd = head(g, logits, with_head)
    if hd is not None and g.private(with_head, [ce.out]):
        covered = with_head
        if ce.flat is not None:  # the log-probabilities' rows regrouped: the head's too
            hd = dataclasses.replace(hd, flat=ce.flat)
    else:  # no head, or its logits are also read elsewhere: they are made anyway
        hd = None
    dtype = ce.out.aval.dtype
    opts = dict(label_smoothing=ce.smoothing, z_loss=ce.z_loss, logit_cap=cap)
    one_hot = ce.reading == Reading.ONE_HOT

    def labels_of(lab):
        lab = lab[..., 0] if ce.unit_labels else lab
        if ce.reading == Reading.CLIPPED:
            return _clip(lab, classes)
        if ce.reading == Reading.NUMPY:  # negative labels from the end, then clamped
            return _clip(idioms.wrap_labels(lab, classes), classes)
        return (
            idioms.wrap_labels(lab, classes)
            if ce.reading == Reading.INDEX and hd is not None
            else lab
        )

    def finish(loss):
        loss = loss.astype(dtype)  # float32 when half logits were upcast
        loss = loss if ce.factor == 1.0 else ce.factor * loss
        loss = loss[..., None] if ce.keep_dim else loss
        # The per-row loss reshaped as the program reshapes it (_cross_entropy_of).
        return loss.reshape(ce.out.aval.shape)

    if hd is not None:

        def call(xv, wv, lab):
            x, w = promoted(hd.dtype, hd.rows(xv), hd.weight(wv))
            if one_hot:
                return finish(one_hot_linear_cross_entropy(x, w, lab, **opts))
            loss = ops.linear_cross_entropy(x, w, labels_of(lab), **opts)
            if ce.reading == Reading.INDEX:  # NaN outside [-V, V), as optax's gather fills
                rows = lab[..., 0] if ce.unit_labels else lab
                loss = jnp.where((rows >= -classes) & (rows < classes), loss, jnp.nan)
            return finish(loss)

        inputs, op = (hd.x, hd.w, ce.labels), "linear_cross_entropy"
    else:

        def call(zv, lab):
            if ce.flat is not None:
                zv = zv.reshape(*ce.flat, classes)
            if one_hot:
                return finish(one_hot_cross_entropy(zv, lab, **opts))
            return finish(ops.softmax_cross_entropy(zv, labels_of(lab), **opts))

        inputs, op = (logits, ce.labels), "softmax_cross_entropy"
    source = f"{ce.source} (structural)" if ce.structural else ce.source
    if cap is not None:
        source += ", soft-capped"
    if hd is not None:
        source += " of x @ w"
    return Replacement(Kind.LOSS, op, source, inputs, frozenset(covered), ce.out, call)


def _clip(labels, classes: int):
    """Labels in ``[0, V)``, as a gather that clips reads them."""
    return jnp.clip(labels, 0, classes - 1)
