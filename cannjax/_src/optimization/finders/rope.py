"""Rotary position embeddings found by meaning: ``x cos + rotate_half(x) sin``, however
the halves are written.

With ``R`` features and ``h = R/2``, RoPE (half-split layout) is, for the two halves
``x0 = x[..., :h]`` and ``x1 = x[..., h:]`` and tables ``c``, ``s`` of ``h`` features::

  y[..., :h] = x0 c - x1 s
  y[..., h:] = x1 c + x0 s

Libraries write it three ways: Hugging Face, haliax and equinox as ``x * C +
rotate_half(x) * S`` with tables ``C = [c, c]``, ``S = [s, s]`` repeated to ``R``
features (``concatenate``, ``tile``, or ``cos`` of repeated angles), and penzai as the
pairwise products of the two halves of a ``split``, concatenated. The interleaved layout
(pairs ``(2i, 2i + 1)``) is read the same way with the parts ``x[..., 0::2]`` and
``x[..., 1::2]``: GPT-J's ``rotate_every_two`` with ``jnp.repeat`` tables, or pairs
reshaped out (``x.reshape(..., h, 2)``) and stacked back. Rather than a template
per spelling, the finder reads the value as a sum of terms ``sign * x_k * table`` for
each output half (through slices, splits, negations, transposes that keep the features
last, products with a table, sums and the concatenation) and checks the four terms above.
A full-width table stands for its half ``c`` only when its two halves are provably equal:
repeated by ``concatenate``/``tile``, computed elementwise from such a table, gathered
along other axes, or a constant whose halves are equal element for element.

The tables must not carry a gradient (computed from literals, constants, integers: the
positions): :func:`cannjax.ops.apply_rope` does not differentiate them. Its backward keeps
the two ``h``-feature tables as the program broadcast them (``[T, 1, h]``, not ``[B, T,
N, R]``) and no copy of ``x``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore

from cannjax import ops
from cannjax._src.core.graph import Graph, is_identity, is_upcast, producer
from cannjax._src.optimization.replacement import Kind, Miss, Replacement

# RoPE is at most two products, a sum and a negation per half, the slices and the
# concatenation of rotate_half, and a few layout moves of x: deeper is something else.
_MAX_DEPTH = 12
# Values read per candidate: RoPE's forms take fewer than 40; a sum of many products
# elsewhere in a model is given up on rather than explored.
_MAX_READS = 200

# Moves of a table towards the layout of x that change no value, only where it sits.
_LAYOUT = ("broadcast_in_dim", "transpose", "reshape")


@dataclasses.dataclass(frozen=True)
class Table:
    """A table as the finder reads it: ``source`` moved by the equations ``chain``.

    Attributes:
      source: the table before its broadcasts and transposes.
      chain: indices of the layout equations from ``source`` to the product's operand.
      full: whether ``source`` has ``R`` features (standing for its half) or ``h``.
      proven: for a full table, whether its halves (or pairs) are provably equal.
    """

    source: Any
    chain: tuple
    full: bool
    proven: bool = True

    def key(self, g: Graph) -> tuple:
        """Equal keys, equal values in the product's layout (the same source moved the
        same way; penzai broadcasts each table once per product)."""
        moves = tuple(
            (g.jaxpr.eqns[i].primitive.name, _params_key(g.jaxpr.eqns[i].params))
            for i in self.chain
        )
        return self.source, moves


@dataclasses.dataclass(frozen=True)
class Term:
    """``sign * x_k * table`` with ``x = transpose(base, perm)`` (no table: ``None``)."""

    base: Any
    perm: tuple
    half: int
    sign: int
    table: Table | None


Sum = tuple  # of Terms


def _params_key(params: dict) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in params.items()))


# ------------------------------------------------------------------------ tables
def _is_layout(e) -> bool:
    """A move that keeps the features last: a broadcast mapping the last axis to the last
    axis, a transpose that fixes it, a reshape of the other axes, a copy."""
    if is_identity(e):
        return True
    name = e.primitive.name
    x, y = e.invars[0].aval, e.outvars[0].aval
    if name not in _LAYOUT or x.ndim == 0 or x.shape[-1] != y.shape[-1]:
        return False
    if name == "broadcast_in_dim":
        return tuple(e.params["broadcast_dimensions"])[-1] == y.ndim - 1
    if name == "transpose":
        return tuple(e.params["permutation"])[-1] == x.ndim - 1
    return e.params.get("dimensions") is None


def _table(g: Graph, t, width: int) -> Table | None:
    """``t`` read as a table of ``width`` features: None when it carries a gradient (or
    is a literal, or has another width)."""
    if t.aval.ndim == 0 or t.aval.shape[-1] != width:
        return None
    if isinstance(t, jcore.Literal) or t in g.differentiable:
        return None
    chain = []
    while True:
        i, e = producer(g, t)
        if e is None or not _is_layout(e) or not _keeps_sizes(e):
            break
        chain.append(i)
        t = e.invars[0]
    return Table(t, tuple(reversed(chain)), full=False)


def _keeps_sizes(e) -> bool:
    """A reshape that only adds or drops unit axes (what :func:`_in_layout` replays)."""
    if e.primitive.name != "reshape":
        return True
    sizes = [[d for d in v.aval.shape if d != 1] for v in (e.invars[0], e.outvars[0])]
    return sizes[0] == sizes[1]


def _halves_equal(g: Graph, v, lo: int, h: int, depth: int) -> bool:
    """Whether ``v[..., lo:lo+h] == v[..., lo+h:lo+2h]`` holds for every value of the
    program: provable from how ``v`` is made."""
    if depth > _MAX_DEPTH or isinstance(v, jcore.Literal):
        return False
    value = g.values.get(v)
    if value is not None:
        a = np.asarray(value)
        return a.ndim > 0 and np.array_equal(a[..., lo : lo + h], a[..., lo + h : lo + 2 * h])
    i, e = producer(g, v)
    if e is None:
        return False
    name, last = e.primitive.name, v.aval.ndim - 1
    if name == "concatenate" and e.params["dimension"] == last:
        # Both ranges inside operands, at the same place of the same operand value.
        spans, start = [], 0
        for u in e.invars:
            spans.append((start, start + u.aval.shape[-1], u))
            start += u.aval.shape[-1]

        def where(a):
            return next(((u, a - s) for s, t, u in spans if s <= a and a + h <= t), None)

        first, second = where(lo), where(lo + h)
        if first is None or second is None:
            return False
        return first[0] is second[0] and first[1] == second[1]
    if name == "tile":
        # value[..., j] = operand[..., j mod w]
        w = e.invars[0].aval.shape[-1]
        if h % w == 0:
            return True
        return lo % w + 2 * h <= w and _halves_equal(g, e.invars[0], lo % w, h, depth + 1)
    if name == "split" and e.params["axis"] == last:
        k = e.outvars.index(v)
        offset = sum(int(s) for s in e.params["sizes"][:k])
        return _halves_equal(g, e.invars[0], lo + offset, h, depth + 1)
    if name == "slice":
        starts, strides = e.params["start_indices"], e.params["strides"]
        if strides is not None and strides[-1] != 1:
            return False
        return _halves_equal(g, e.invars[0], lo + starts[-1], h, depth + 1)
    return _keeps_features(e) and _halves_equal(g, e.invars[0], lo, h, depth + 1)


# Functions of one value, element by element: equal halves in, equal halves out.
_ELEMENTWISE_UNARY = frozenset(
    ("cos", "sin", "neg", "exp", "convert_element_type", "copy", "copy_p", "abs")
)


def _keeps_features(e) -> bool:
    """Whether ``e``'s output has its operand's features, in order, at every position it
    holds (so equal halves or pairs stay equal): an elementwise function, a layout move,
    rows gathered whole."""
    if e.primitive.name == "gather":
        return _gathered_whole_rows(e)
    return e.primitive.name in _ELEMENTWISE_UNARY or _is_layout(e)


def _gathered_whole_rows(e) -> bool:
    """A gather that takes whole slices of the operand's last axis, to the output's last
    axis (``table[position_ids]``): it moves rows, never features."""
    dn = e.params["dimension_numbers"]
    operand, out = e.invars[0].aval, e.outvars[0].aval
    last = operand.ndim - 1
    return (
        last not in dn.collapsed_slice_dims
        and last not in dn.start_index_map
        and last not in getattr(dn, "operand_batching_dims", ())
        and e.params["slice_sizes"][-1] == operand.shape[-1]
        and tuple(dn.offset_dims)[-1:] == (out.ndim - 1,)
        and out.shape[-1] == operand.shape[-1]
    )


def _pairs_equal(g: Graph, v, depth: int) -> bool:
    """Whether ``v[..., 0::2] == v[..., 1::2]`` for every value of the program: a table
    repeated by ``jnp.repeat(t, 2, -1)``, or computed from one elementwise, or a constant."""
    if depth > _MAX_DEPTH or isinstance(v, jcore.Literal):
        return False
    value = g.values.get(v)
    if value is not None:
        a = np.asarray(value)
        return a.ndim > 0 and a.shape[-1] % 2 == 0 and np.array_equal(a[..., 0::2], a[..., 1::2])
    i, e = producer(g, v)
    if e is None:
        return False
    if e.primitive.name == "reshape" and e.params.get("dimensions") is None:
        # [..., h, 2] -> [..., R] of a broadcast along the new last axis: jnp.repeat.
        u = e.invars[0]
        if tuple(u.aval.shape) != (*v.aval.shape[:-1], v.aval.shape[-1] // 2, 2):
            return False
        j, b = producer(g, u)
        if b is None or b.primitive.name != "broadcast_in_dim":
            return False
        return u.aval.ndim - 1 not in tuple(b.params["broadcast_dimensions"])
    return _keeps_features(e) and _pairs_equal(g, e.invars[0], depth + 1)


def _whole(starts, limits, u) -> bool:
    """A slice that keeps every axis of ``u`` but the last whole."""
    return all(s == 0 and lim == n for s, lim, n in zip(starts[:-1], limits[:-1], u.aval.shape))


# ------------------------------------------------------------------------ terms
@dataclasses.dataclass
class _Reader:
    """Reads values as sums of terms, recording the equations it passes."""

    g: Graph
    width: int  # R
    pairs: bool = False  # the interleaved layout: parts x[..., 0::2] and x[..., 1::2]
    covered: set = dataclasses.field(default_factory=set)
    reads: int = 0

    def full(self, v, depth: int = 0) -> tuple[Sum, Sum] | None:
        """The two halves of ``v`` (``R`` features) as sums of terms; ``v`` itself (``x``)
        when it is not made of products with tables."""
        if depth > _MAX_DEPTH or v.aval.ndim == 0 or v.aval.shape[-1] != self.width:
            return None
        self.reads += 1
        if self.reads > _MAX_READS:
            return None
        i, e = producer(self.g, v)
        if e is not None:
            before = set(self.covered)
            out = self._full_of(i, e, depth)
            # x moved, or rotate_half(x) (rotate_every_two: a reshape): kept without a table.
            moves_x = e.primitive.name in ("transpose", "concatenate", "reshape")
            moves_x = moves_x or is_identity(e) or is_upcast(e)
            if out is not None and (moves_x or any(t.table for t in _terms(out))):
                return out
            self.covered = before
        ident = tuple(range(v.aval.ndim))
        return (Term(v, ident, 0, 1, None),), (Term(v, ident, 1, 1, None),)

    def _full_of(self, i, e, depth):
        h = self.width // 2
        last = e.outvars[0].aval.ndim - 1
        if self.pairs and e.primitive.name == "reshape":
            return self._interleaved(i, e, depth)
        if e.primitive.name == "concatenate" and e.params["dimension"] == last:
            if len(e.invars) != 2 or any(u.aval.shape[-1] != h for u in e.invars):
                return None
            a, b = (self.half(u, depth + 1) for u in e.invars)
            if a is None or b is None:
                return None
            self.covered.add(i)
            return a, b
        return self._combine(i, e, depth, self.full, self.width)

    def _interleaved(self, i, e, depth):
        """``stack([a, b], -1).reshape(..., R)``: the pairs ``(a_j, b_j)`` interleaved."""
        h, out = self.width // 2, e.outvars[0].aval
        if e.primitive.name != "reshape" or e.params.get("dimensions") is not None:
            return None
        if tuple(e.invars[0].aval.shape) != (*out.shape[:-1], h, 2):
            return None
        j, st = producer(self.g, e.invars[0])
        if st is None or st.primitive.name != "stack" or len(st.invars) != 2:
            return None
        if st.params["axis"] != out.ndim:
            return None
        a, b = (self.half(u, depth + 1) for u in st.invars)
        if a is None or b is None:
            return None
        self.covered.update((i, j))
        return a, b

    def _part(self, i, e, depth):
        """``x[..., k::2]`` or ``x.reshape(..., h, 2)[..., k]``: part ``k`` of a value read
        by :meth:`full` in the interleaved layout."""
        name = e.primitive.name
        if name == "slice":
            u = e.invars[0]
            starts, limits, strides = (
                e.params["start_indices"],
                e.params["limit_indices"],
                e.params["strides"],
            )
            if strides is None or tuple(strides[:-1]) != (1,) * (len(strides) - 1):
                return None
            if strides[-1] != 2 or starts[-1] not in (0, 1) or not _whole(starts, limits, u):
                return None
            halves = self.full(u, depth + 1) if u.aval.shape[-1] == self.width else None
            if halves is None:
                return None
            self.covered.add(i)
            return halves[starts[-1]]
        if name in ("squeeze", "reshape") and e.invars[0].aval.shape[-1] == 1:
            j, sl = producer(self.g, e.invars[0])
            if sl is None or sl.primitive.name != "slice" or sl.params["strides"] is not None:
                return None
            starts, limits = sl.params["start_indices"], sl.params["limit_indices"]
            pairs = sl.invars[0]
            if pairs.aval.shape[-1] != 2 or not _whole(starts[:-1], limits[:-1], pairs):
                return None
            k, rs = producer(self.g, pairs)
            if rs is None or rs.primitive.name != "reshape":
                return None
            u = rs.invars[0]
            if tuple(u.aval.shape) != (*pairs.aval.shape[:-2], self.width):
                return None
            halves = self.full(u, depth + 1)
            if halves is None:
                return None
            self.covered.update((i, j, k))
            return halves[starts[-1]]
        return None

    def half(self, v, depth: int) -> Sum | None:
        """``v`` of ``h`` features as a sum of terms."""
        h = self.width // 2
        if depth > _MAX_DEPTH or v.aval.ndim == 0 or v.aval.shape[-1] != h:
            return None
        self.reads += 1
        if self.reads > _MAX_READS:
            return None
        i, e = producer(self.g, v)
        if e is None:
            return None
        name, last = e.primitive.name, v.aval.ndim - 1
        if self.pairs:
            part = self._part(i, e, depth)
            if part is not None:
                return part
            if name in ("slice", "squeeze", "reshape"):
                return None
        elif name == "slice":
            u = e.invars[0]
            starts, limits = e.params["start_indices"], e.params["limit_indices"]
            strides = e.params["strides"]
            whole = all(
                s == 0 and lim == n
                for s, lim, n in zip(starts[:-1], limits[:-1], u.aval.shape[:-1])
            )
            if not whole or (strides is not None and any(st != 1 for st in strides)):
                return None
            if starts[-1] not in (0, h) or u.aval.shape[-1] != self.width:
                return None
            halves = self.full(u, depth + 1)
            if halves is None:
                return None
            self.covered.add(i)
            return halves[starts[-1] // h]
        if not self.pairs and name == "split" and e.params["axis"] == last and len(e.outvars) == 2:
            halves = self.full(e.invars[0], depth + 1)
            if halves is None:
                return None
            self.covered.add(i)
            return halves[e.outvars.index(v)]
        return self._combine(i, e, depth, self.half, h)

    def _combine(self, i, e, depth, read, width):
        """Sums, differences, negations, products with a table, transposes that keep the
        features last and copies of values read by ``read``; None for anything else."""
        name = e.primitive.name
        if is_identity(e) or is_upcast(e):  # exact: commutes with every step here
            out = read(e.invars[0], depth + 1)
        elif name == "neg":
            out = _map(read(e.invars[0], depth + 1), lambda t: _signed(t, -1))
        elif name in ("add", "sub") and _same_shapes(e):
            a, b = (read(u, depth + 1) for u in e.invars)
            if a is None or b is None:
                return None
            if name == "sub":
                b = _map(b, lambda t: _signed(t, -1))
            out = _plus(a, b)
        elif name == "transpose" and e.params["permutation"][-1] == e.invars[0].aval.ndim - 1:
            perm = tuple(e.params["permutation"])
            out = _map(read(e.invars[0], depth + 1), lambda t: _moved(t, perm))
        elif name == "mul":
            out = self._product(e, depth, read, width)
        else:
            return None
        if out is None or any(t is None for t in _terms(out)):
            return None
        self.covered.add(i)
        return out

    def _product(self, e, depth, read, width):
        """``x * table`` (either order) with ``x`` read by ``read``."""
        shape = tuple(e.outvars[0].aval.shape)
        for a, t in (e.invars, e.invars[::-1]):
            if not isinstance(a, jcore.Var) or tuple(a.aval.shape) != shape:
                continue
            table = _table(self.g, t, width)
            if table is None:
                continue
            if width == self.width:  # [c, c] stands for c only with equal halves
                if self.pairs:
                    proven = _pairs_equal(self.g, table.source, 0)
                else:
                    proven = _halves_equal(self.g, table.source, 0, width // 2, 0)
                table = dataclasses.replace(table, full=True, proven=proven)
            x = read(a, depth + 1)
            return _map(x, lambda term, table=table: _times(term, table))
        return None


def _terms(out) -> list:
    if isinstance(out, tuple) and out and isinstance(out[0], tuple):  # two halves
        return [t for half in out for t in half]
    return list(out)


def _map(out, f):
    if out is None:
        return None
    if out and isinstance(out[0], tuple):
        return tuple(tuple(f(t) for t in half) for half in out)
    return tuple(f(t) for t in out)


def _plus(a, b):
    if a and isinstance(a[0], tuple):
        return tuple(x + y for x, y in zip(a, b))
    return a + b


def _signed(t: Term | None, s: int):
    return None if t is None else dataclasses.replace(t, sign=t.sign * s)


def _moved(t: Term | None, perm: tuple):
    if t is None or t.table is not None:  # a product's layout is the output's
        return None
    return dataclasses.replace(t, perm=tuple(t.perm[p] for p in perm))


def _times(t: Term | None, table: Table):
    if t is None or t.table is not None:
        return None
    return dataclasses.replace(t, table=table)


def _same_shapes(e) -> bool:
    return all(tuple(u.aval.shape) == tuple(e.outvars[0].aval.shape) for u in e.invars)


# ------------------------------------------------------------------------ the finder
def find_rope(g: Graph, i: int):
    """RoPE whose last equation is ``i``: the sum of ``x cos`` and ``rotate_half(x) sin``
    (or ``rotate_every_two``), or the rotated parts put together (a concatenation of
    halves, or the reshape of stacked pairs)."""
    e = g.jaxpr.eqns[i]
    if e.primitive.name not in ("add", "sub", "concatenate", "reshape") or len(e.outvars) != 1:
        return None
    out = e.outvars[0]
    if out.aval.ndim < 2 or not jnp.issubdtype(out.aval.dtype, jnp.floating):
        return None
    R = out.aval.shape[-1]
    if R % 2 or R < 2:
        return None
    near = None
    for pairs in (False, True):
        reader = _Reader(g, R, pairs)
        halves = reader.full(out)
        if halves is None or all(t.table is None for t in _terms(halves)):
            continue
        form = _rotation(g, halves, pairs)
        if isinstance(form, Miss):
            near = form
        elif form is not None:
            return _replacement(g, e, reader, form)
    return near


# What a rotation needs of a table repeated to R features, when that was not proven.
_UNPROVEN = {
    False: "x * cos + rotate_half(x) * sin whose cos or sin table's two halves are not "
    "provably equal (repeated by concatenate or tile, or a constant with equal halves)",
    True: "x * cos + rotate_every_two(x) * sin whose cos or sin table does not provably "
    "repeat each value twice (jnp.repeat(t, 2, -1), or a constant)",
}


def _replacement(g: Graph, e, reader: _Reader, form):

    out = e.outvars[0]
    R, pairs = out.aval.shape[-1], reader.pairs
    base, perm, c, s, sign = form
    if e.primitive.name in ("add", "sub"):
        rotate = "rotate_every_two" if pairs else "rotate_half"
        source = f"x * cos + {rotate}(x) * sin"
    else:
        source = "pairwise rotation of " + ("interleaved pairs" if pairs else "the two halves")
    h = R // 2

    def call(x, cos_source, sin_source):
        if perm != tuple(range(len(perm))):
            x = jax.lax.transpose(x, perm)
        x = x.astype(out.aval.dtype)  # the upcasts read through (exact)
        cos = _in_layout(g, c, cos_source, h, pairs)
        sin = _in_layout(g, s, sin_source, h, pairs)
        sin = sin if sign > 0 else -sin
        return ops.apply_rope(x, cos, sin, interleaved=pairs).astype(out.aval.dtype)

    inputs = (base, c.source, s.source)
    return Replacement(
        Kind.ROPE, "apply_rope", source, inputs, frozenset(reader.covered), out, call
    )


def _rotation(g: Graph, halves, pairs: bool):
    """``(base, perm, cos table, sin table, sign)`` when the halves are ``(x0 c - x1 s,
    x1 c + x0 s)`` (``sign`` -1: ``s`` negated throughout); a :class:`Miss` when they are
    but a repeated table was not proven to repeat; else None."""
    first, second = halves
    if len(first) != 2 or len(second) != 2:
        return None
    terms = [*first, *second]
    if any(t.table is None for t in terms):
        return None
    bases = {(t.base, t.perm) for t in terms}
    if len(bases) != 1:
        return None
    by = [{t.half: t for t in half} for half in (first, second)]
    if any(set(b) != {0, 1} for b in by):
        return None
    c0, s0 = by[0][0], by[0][1]  # y0 = x0 c - x1 s
    c1, s1 = by[1][1], by[1][0]  # y1 = x1 c + x0 s
    if c0.sign != 1 or c1.sign != 1 or s0.sign != -s1.sign:
        return None
    if c0.table.key(g) != c1.table.key(g) or s0.table.key(g) != s1.table.key(g):
        return None
    if not (c0.table.proven and s0.table.proven):
        return Miss(_UNPROVEN[pairs])
    ((base, perm),) = bases
    return base, perm, c0.table, s0.table, s1.sign


def _in_layout(g: Graph, table: Table, value, h: int, pairs: bool):
    """``table``'s value moved as the program moves it, with its broadcast axes kept at
    size 1 (so the operator keeps the small table), and of a full table its first ``h``
    features (``pairs``: every second one)."""
    flags = [False] * value.ndim
    for i in table.chain:
        e = g.jaxpr.eqns[i]
        name = e.primitive.name
        if name == "broadcast_in_dim":
            dims = tuple(e.params["broadcast_dimensions"])
            shape = e.outvars[0].aval.shape
            new = [shape[a] > 1 for a in range(len(shape))]
            for k, a in enumerate(dims):
                new[a] = flags[k] or (value.shape[k] == 1 and shape[a] > 1)
            value = jax.lax.broadcast_in_dim(value, shape, dims)
            flags = new
        elif name == "transpose":
            perm = tuple(e.params["permutation"])
            value = jax.lax.transpose(value, perm)
            flags = [flags[p] for p in perm]
        elif name == "reshape":
            shape = tuple(e.params["new_sizes"])
            kept = [f for f, n in zip(flags, value.shape) if n != 1]
            value = jnp.reshape(value, shape)
            it = iter(kept)
            flags = [next(it, False) if n != 1 else False for n in shape]
        # copies and same-dtype converts change nothing
    index = tuple(slice(0, 1) if f else slice(None) for f in flags)
    value = value[index]
    if not table.full:
        return value
    return value[..., ::2] if pairs else value[..., :h]
