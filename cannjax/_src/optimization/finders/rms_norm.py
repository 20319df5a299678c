"""RMS norms matched by meaning: ``x * scale / sqrt(mean(x^2) + eps)`` however it is spelled.

Libraries write the same norm many ways (the corpus of ``benchmarks/corpus`` has six):
the square as ``square``, ``integer_pow(x, 2)``, ``pow(x, 2)`` or ``x * x``; the mean as a
sum divided by ``d`` or times ``1 / d``; the root as ``rsqrt``, ``1 / sqrt``,
``sqrt(.) ** -1`` or a division by ``sqrt``; ``eps`` a literal or a closed-over constant;
the scale ``g`` or ``1 + g``, before or after it is broadcast, on either side of the
product. Rather than a template per spelling, :func:`find_rms_norm` reads the product at
an equation as a list of factors and accepts it only when they are exactly ``x``, one row
statistic ``(mean over the last axis of x^2 + eps) ** -1/2`` of that same ``x``, and at
most one scale broadcast along the last axis. Every equation of the match has a known
role and every constant its checked value, so a match is still a proof of equal math.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from jax._src import core as jcore

from cannjax import ops
from cannjax._src.core import jaxpr as J
from cannjax._src.core.graph import Graph, is_upcast, scalar, squared
from cannjax._src.optimization.finders.dense import _bias_source
from cannjax._src.optimization.replacement import Kind, Miss, Replacement

# Factors of a product are followed this many multiplications deep (a scale and a
# statistic on either side of ``x`` need three; more would only admit unrelated code).
_PRODUCT_DEPTH = 4


@dataclasses.dataclass(frozen=True)
class _Factor:
    """A factor ``v ** power`` of the product, with the equations that combined it."""

    v: Any
    power: int
    via: frozenset


def _factors(g: Graph, v: Any, stop: Any, depth: int, power: int = 1) -> list[_Factor]:
    """``v`` as a product of factors through ``mul`` and ``div`` (``stop`` is atomic)."""
    e = g.eqn_of(v)
    if depth == 0 or v is stop or e is None:
        return [_Factor(v, power, frozenset())]
    here = frozenset({g.producer[v][0]})
    if e.primitive.name == "copy" and isinstance(e.invars[0], jcore.Var):
        out = _factors(g, e.invars[0], stop, depth, power)
        return [dataclasses.replace(out[0], via=out[0].via | here), *out[1:]]
    scaled = _vector_product(g, e)
    if scaled is not None:  # penzai: a dot_general without contraction, then a transpose
        y, w, dot = scaled
        out = _factors(g, y, stop, depth - 1, power)
        head = dataclasses.replace(out[0], via=out[0].via | here | {dot})
        return [head, *out[1:], _Factor(w, power, frozenset())]
    if e.primitive.name not in ("mul", "div"):
        return [_Factor(v, power, frozenset())]
    a, b = e.invars
    if not all(isinstance(u, jcore.Var) for u in (a, b)):
        return [_Factor(v, power, frozenset())]
    if not (_fits(a.aval.shape, v.aval.shape) and _fits(b.aval.shape, v.aval.shape)):
        return [_Factor(v, power, frozenset())]
    sign = -1 if e.primitive.name == "div" else 1
    out = _factors(g, a, stop, depth - 1, power) + _factors(g, b, stop, depth - 1, power * sign)
    return [dataclasses.replace(out[0], via=out[0].via | here), *out[1:]]


def _vector_product(g: Graph, e) -> tuple[Any, Any, int] | None:
    """``(y, w, dot index)`` when ``e`` is ``transpose(dot_general(y, w))`` that multiplies
    ``y`` by the vector ``w`` along its last axis (batch dimensions, no contraction) and
    puts that axis back last: ``y * w`` as penzai's named-axis multiply writes it."""
    if e.primitive.name != "transpose" or not isinstance(e.invars[0], jcore.Var):
        return None
    d = g.eqn_of(e.invars[0])
    if d is None or d.primitive.name != "dot_general":
        return None
    (lc, rc), (lb, rb) = d.params["dimension_numbers"]
    y, w = d.invars
    r = y.aval.ndim
    perm = tuple(e.params["permutation"])
    if lc or rc or tuple(lb) != (r - 1,) or tuple(rb) != (0,) or w.aval.ndim != 1:
        return None
    if perm != (*range(1, r), 0) or not isinstance(y, jcore.Var) or not isinstance(w, jcore.Var):
        return None
    return y, w, g.producer[e.invars[0]][0]


def _fits(part: tuple, whole: tuple) -> bool:
    """Whether an operand of shape ``part`` broadcasts to ``whole`` by its unit axes only
    (lax's binary operators take ``[..., 1]`` against ``[..., d]``)."""
    return len(part) == len(whole) and all(p in (1, w) for p, w in zip(part, whole))


def _row(g: Graph, v: Any, shape: tuple, chain: set) -> Any:
    """``v`` before it was broadcast along the last axis of ``shape``: the nearest value
    up a chain of ``broadcast_in_dim``, ``transpose`` and unit ``reshape`` whose axes are
    the leading axes of ``shape`` in order (``[...]`` or ``[..., 1]``). Named-axis code
    broadcasts the new axis first and transposes it last. Adds the chain to ``chain``."""
    last = len(shape) - 1
    # roles[k]: which axis of the final value axis k of ``cur`` is (``last``: the
    # broadcast one, at size 1 or d).
    roles, cur, walked, best, best_walked = list(range(len(v.aval.shape))), v, [], v, []
    while True:
        e = g.eqn_of(cur)
        if e is None or not e.invars or not isinstance(e.invars[0], jcore.Var):
            break  # an input, or made from nothing (iota)
        name, src = e.primitive.name, e.invars[0]
        s = tuple(src.aval.shape)
        if (
            name == "convert_element_type"
            and J.is_float(src.aval.dtype)
            and J.is_float(cur.aval.dtype)
        ):
            new = roles  # a statistic rounded to half and back (penzai on bf16 arrays)
        elif name == "transpose":
            new = [0] * len(roles)
            for j, p in enumerate(e.params["permutation"]):
                new[p] = roles[j]
        elif name == "broadcast_in_dim":
            dims = tuple(e.params["broadcast_dimensions"])
            t = tuple(cur.aval.shape)
            grown = [a for a in range(len(t)) if a not in dims] + [
                dims[k] for k in range(len(s)) if s[k] != t[dims[k]]
            ]
            if any(roles[a] != last for a in grown):
                break
            new = [roles[dims[k]] for k in range(len(s))]
        elif name == "reshape" and tuple(cur.aval.shape) == (*s, 1) and roles[-1] == last:
            new = roles[:-1]
        elif name == "reshape" and s == (*cur.aval.shape, 1):
            new = [*roles, last]
        else:
            break
        walked.append(g.producer[cur][0])
        roles, cur = new, src
        if roles in (list(range(last)), list(range(last + 1))) and s[last:] in ((), (1,)):
            best, best_walked = cur, list(walked)
    chain.update(best_walked)
    return best


def _power_of_root(g: Graph, v: Any, chain: set) -> tuple[Any, int] | None:
    """``(s, p)`` with ``v = s ** (p / 2)``, ``p`` in {-1, 1}: ``rsqrt(s)``, ``sqrt(s)``,
    ``pow(s, -0.5)``, ``1 / sqrt(s)`` or ``sqrt(s) ** -1``."""
    e = g.eqn_of(v)
    if e is None:
        return None
    name, i = e.primitive.name, g.producer[v][0]
    if name in ("rsqrt", "sqrt"):
        chain.add(i)
        return e.invars[0], -1 if name == "rsqrt" else 1
    if name == "pow" and scalar(g, e.invars[1]) in (-0.5, 0.5):  # jnp.power(s, -0.5)
        chain.add(i)
        return e.invars[0], int(2 * scalar(g, e.invars[1]))
    if name == "div" and scalar(g, e.invars[0]) == 1.0:
        inner = _power_of_root(g, e.invars[1], chain)
        if inner is not None:
            chain.add(i)
            return inner[0], -inner[1]
    if name == "integer_pow" and e.params["y"] == -1:
        inner = _power_of_root(g, e.invars[0], chain)
        if inner is not None:
            chain.add(i)
            return inner[0], -inner[1]
    return None


def _square_of(g: Graph, v: Any, chain: set) -> Any:
    """``x`` where ``v = x^2`` in any spelling (:func:`graph.squared`), or its upcast
    (a half ``x`` squared, then summed in float32), else None."""
    e = g.eqn_of(v)
    if e is not None and is_upcast(e) and isinstance(e.invars[0], jcore.Var):
        x = _square_of(g, e.invars[0], chain)
        if x is not None:
            chain.add(g.producer[v][0])
        return x
    x = squared(g, v)
    if x is None:
        return None
    chain.add(g.producer[v][0])
    while (c := g.eqn_of(x)) is not None and c.primitive.name == "copy":
        if len(g.consumers(x)) != 1 or not isinstance(c.invars[0], jcore.Var):
            break
        chain.add(g.producer[x][0])  # penzai copies x before squaring it
        x = c.invars[0]
    return x


def _last_moved(shape: tuple, axis: int) -> tuple:
    """``shape`` with its last axis moved to position ``axis``."""
    return (*shape[:axis], shape[-1], *shape[axis:-1])


def _mean_square(g: Graph, v: Any, shape: tuple, chain: set) -> Any:
    """``(x, axis)`` where ``v`` (a row value, ``shape`` without its last axis) is the mean
    of ``x^2`` over ``axis``: ``x`` is the normalized value with its last axis at
    ``axis`` (named-axis layouts reduce the features where they are)."""
    e = g.eqn_of(v)
    if e is None or e.primitive.name not in ("div", "mul"):
        return None
    d = shape[-1]
    for total, k in (e.invars, e.invars[::-1]):
        c = scalar(g, k)
        if c is None or not isinstance(total, jcore.Var):
            continue
        if (e.primitive.name == "div" and c == d) or (
            e.primitive.name == "mul" and np.float32(c) == np.float32(1.0 / d)
        ):
            inner = set()
            s = _row(g, total, shape, inner)
            r = g.eqn_of(s)
            if r is None or r.primitive.name != "reduce_sum":
                return None
            axes = tuple(int(a) for a in r.params["axes"])
            x = _square_of(g, r.invars[0], inner)
            if x is None or len(axes) != 1 or _last_moved(shape, axes[0]) != x.aval.shape:
                return None
            chain.update(inner | {g.producer[v][0], g.producer[s][0]})
            return x, axes[0]
        if e.primitive.name == "div":
            break  # only the divisor may be the constant
    return None


def _row_statistic(g: Graph, f: _Factor, shape: tuple):
    """``((x, axis), eps, chain)`` when ``f`` is ``(mean(x^2) + eps) ** -1/2`` with the
    mean over ``axis`` of ``x``; a :class:`Miss` when ``f`` is a root (or a sum with a root) of a
    row sum but fails a check (a near miss); else None."""
    chain: set = set()
    v = _row(g, f.v, shape, chain)
    root = _power_of_root(g, v, chain)
    if root is None:
        e = g.eqn_of(v)
        if e is not None and e.primitive.name in ("add", "sub") and f.power == -1:
            for r, k in (e.invars, e.invars[::-1]):
                near = _power_of_root(g, r, set()) if isinstance(r, jcore.Var) else None
                if near and scalar(g, k) is not None and _sums_rows(g, near[0]):
                    return Miss(f"{_NEAR} but eps is added outside the root")
        return None
    if not _sums_rows(g, root[0]):
        return None  # a root of something else (sqrt(head_dim), a norm of a constant)
    if root[1] * f.power != -1:
        return Miss(f"{_NEAR} but x is multiplied by the root of its statistic, not its inverse")
    s = _row(g, root[0], shape, chain)
    e = g.eqn_of(s)
    if e is None or e.primitive.name != "add":
        return Miss(f"{_NEAR} but the root's argument is not mean(x^2) + eps")
    why = Miss(f"{_NEAR} but the statistic is not the mean of x^2 over the features (sum / d)")
    for m, k in (e.invars, e.invars[::-1]):
        eps = scalar(g, _row(g, k, shape, set()) if isinstance(k, jcore.Var) else k)
        if eps is not None and not (np.isfinite(eps) and eps >= 0):
            why = Miss(f"{_NEAR} but eps = {eps:g} (a norm needs a finite eps >= 0)")
        if eps is None or not np.isfinite(eps) or eps < 0 or not isinstance(m, jcore.Var):
            continue
        mean_chain = set()
        x = _mean_square(g, _row(g, m, shape, mean_chain), shape, mean_chain)
        if x is not None:
            if isinstance(k, jcore.Var):
                _row(g, k, shape, chain)
            return x, float(eps), chain | mean_chain | {g.producer[s][0]}
    return why


_NEAR = "RMS norm (x / sqrt(mean(x^2) + eps))"


def _sums_rows(g: Graph, v: Any, depth: int = 6) -> bool:
    """Whether a ``reduce_sum`` is at most ``depth`` equations upstream of ``v``: what
    makes a root a row statistic worth a near-miss reason."""
    frontier = [v]
    for _ in range(depth):
        nxt = []
        for u in frontier:
            e = g.eqn_of(u)
            if e is None:
                continue
            if e.primitive.name == "reduce_sum":
                return True
            nxt += [a for a in e.invars if isinstance(a, jcore.Var)]
        frontier = nxt
    return False


def _scale(g: Graph, f: _Factor, d: int):
    """``(g, plus_one, chain)`` when ``f`` is ``g`` or ``1 + g`` (``g`` of shape ``[d]``)
    broadcast along the last axis, else None."""
    if f.power != 1:
        return None
    src = _bias_source(g, f.v, (d,))
    if src is not None:
        return src[0], False, set(src[1])
    e = g.eqn_of(f.v)
    if e is None or e.primitive.name != "add":
        return None
    for one, b in (e.invars, e.invars[::-1]):
        if scalar(g, one) == 1.0 and isinstance(b, jcore.Var):
            src = _bias_source(g, b, (d,))
            if src is not None:
                return src[0], True, set(src[1]) | {g.producer[f.v][0]}
    return None


def find_rms_norm(g: Graph, i: int):
    """An RMS norm over the last axis ending at equation ``i`` (a ``mul``, ``div``, or
    the ``transpose`` or ``copy`` of penzai's scale)."""

    eqn = g.jaxpr.eqns[i]
    if eqn.primitive.name not in ("mul", "div", "transpose", "copy") or len(eqn.outvars) != 1:
        return None
    out = eqn.outvars[0]
    if not J.is_float(out.aval.dtype):
        return None
    shape = tuple(out.aval.shape)
    if not shape or shape[-1] < 2:
        return None
    why = None  # the reason of the first near miss, if no factor matches
    for f in _factors(g, out, None, _PRODUCT_DEPTH):
        stat = _row_statistic(g, f, shape)
        if stat is None or isinstance(stat, Miss):
            why = why or stat
            continue
        (x_sq, axis), eps, chain = stat
        if _centered(g, x_sq, shape):
            return None  # a layer norm: the layer-norm finders take it whole
        for x in _laid_out(g, x_sq, axis, shape):
            factors = _factors(g, out, x, _PRODUCT_DEPTH)
            xs = [h for h in factors if h.v is x and h.power == 1]
            stats = [h for h in factors if h.v is f.v and h.power == f.power]
            rest = [h for h in factors if h not in xs and h not in stats]
            if len(xs) == 1 and len(stats) == 1 and len(rest) <= 1:
                break
        else:
            why = why or Miss(f"{_NEAR} but the product holds x other than once, or more factors")
            continue
        covered = set(chain) | {i}
        for h in factors:
            covered |= h.via
        scale = None
        if rest:
            scale = _scale(g, rest[0], shape[-1])
            if scale is None:
                continue
            covered |= scale[2]
        return _replacement(Replacement, x, eps, scale, frozenset(covered), out)
    return why


def _centered(g: Graph, x: Any, shape: tuple) -> bool:
    """Whether ``x = a - mean(a)``: an RMS norm of it is a layer norm of ``a``."""
    e = g.eqn_of(x)
    if e is None or e.primitive.name != "sub" or not isinstance(e.invars[1], jcore.Var):
        return False
    m = g.eqn_of(_row(g, e.invars[1], shape, set()))
    if m is None or m.primitive.name not in ("div", "mul"):
        return False
    for u in m.invars:
        r = g.eqn_of(_row(g, u, shape, set())) if isinstance(u, jcore.Var) else None
        if r is not None and r.primitive.name == "reduce_sum":
            return True
    return False


def _laid_out(g: Graph, x: Any, axis: int, shape: tuple) -> list:
    """The values that are ``x`` with its axis ``axis`` last: ``x`` itself when that is its
    last axis, else its transposes that move only that axis to the end; and the same of
    ``x``'s upcasts (a half ``x`` whose statistic is summed in float32 and which is
    normalized in float32: the norm then reads the upcast)."""
    n = len(shape)
    ups = [x] + [e.outvars[0] for j in g.consumers(x) if is_upcast(e := g.jaxpr.eqns[j])]
    if axis == n - 1:
        return ups
    perm = (*(k for k in range(n) if k != axis), axis)
    out = []
    for u in ups:
        for j in g.consumers(u):
            e = g.jaxpr.eqns[j]
            if e.primitive.name == "transpose" and tuple(e.params["permutation"]) == perm:
                out.append(e.outvars[0])
    return out


def _replacement(Replacement, x, eps, scale, covered, out):
    if scale is None:

        def call(x):
            return ops.rms_norm(x, np.ones(x.shape[-1], x.dtype), eps=eps)

        return Replacement(
            Kind.NORM, "rms_norm", "x / rms(x) (structural)", (x,), covered, out, call
        )
    w, plus_one, _ = scale

    def call(x, w):
        return ops.rms_norm(x, (1 + w if plus_one else w).astype(x.dtype), eps=eps)

    source = "x / rms(x) * (1 + g) (structural)" if plus_one else "x / rms(x) * g (structural)"
    return Replacement(Kind.NORM, "rms_norm", source, (x, w), covered, out, call)
