"""Layer and RMS norms recognized by what they compute, verified by evaluation.

A layer norm ``(x - m) / sqrt(v + eps) * g + b`` (``m``, ``v`` the mean and variance of
each row of ``x``) has many algebraically equal spellings: the variance as ``jnp.var``,
``mean((x - m)^2)`` or ``mean(x^2) - m^2``; the scale folded into the inverse deviation
and the mean subtracted after the multiply (``x * (r * g) + (b - m * r * g)``); the bias
added before the scale is applied to the rest. Templates meet the spellings someone has
written down; this finder meets the others.

:func:`find_norm` takes the region of smooth row-wise algebra that ends at an
equation (sums, products, quotients, powers and roots, reductions over the last axis,
row-wise dot products, broadcasts and unit reshapes: no comparison, select or other
dot, but for a row statistic clamped at zero, ``max(0, v)``, as flax clamps
``mean(x^2) - mean(x)^2``), whose inputs are ``x``
(a value whose rows, or whose squares' rows, the region sums), at most two feature
vectors and constants. It evaluates the region in float64 NumPy at a random point and
compares it with the layer norm, then the RMS norm, of the same ``x`` for each way of
reading the vectors as scale (``g`` or ``1 + g``) and bias and each constant the region
adds as ``eps``. The region's functions are analytic where
they are defined, so two of them that agree at a random point are equal with
probability one (the zero set of a nonzero analytic function has measure zero): equal
values there mean an equal function, so equal gradients too. A region that computes
something else (eps outside the root, a different axis, a missing centring) is left
alone, and the report says so. A clamp ``max(0, v)`` is evaluated only where ``v > 0``
(else the region is not verified): there it is ``v``, so the region agrees with an
analytic function, and a region that then equals a norm's function has ``v`` equal to
the norm's variance, which is never negative: the clamp never acts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from jax._src import core as jcore

from cannjax import ops
from cannjax._src.core import jaxpr as J
from cannjax._src.core.graph import Graph, constant_value, is_upcast, squared
from cannjax._src.optimization.replacement import Kind, Miss, Replacement

# Primitives a region may hold: smooth where defined, row-wise along the leading axes.
_ELEMENTWISE = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
    "neg": np.negative,
    "sqrt": np.sqrt,
    "rsqrt": lambda a: 1.0 / np.sqrt(a),
    "square": np.square,
    "convert_element_type": lambda a: a,  # evaluated in float64 throughout
    "copy": lambda a: a,
}
_MAX_REGION = 48  # equations; a norm takes 8 to 20
_ROWS = 2  # rows evaluated per leading axis
_RTOL = 1e-9


@dataclasses.dataclass(frozen=True)
class _Region:
    """The equations from ``x`` and the leaves to the anchor's output, in program order."""

    eqns: tuple[int, ...]
    leaves: tuple  # non-constant vars it reads besides x (the feature vectors)
    constants: dict  # var -> value, for inputs known to be constant
    chosen: dict  # eqn index -> the case a select_n with a constant predicate takes


def _row_dot(e) -> bool:
    """Whether ``e`` is a row-wise dot product: ``sum(a * b, -1)`` as a ``dot_general``
    batched over every leading axis (``jnp.einsum("td,td->t", x, x)``)."""
    if e.primitive.name != "dot_general" or len(e.invars) != 2:
        return False
    a, b = e.invars
    r = a.aval.ndim
    lead = tuple(range(r - 1))
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    return (
        a.aval.shape == b.aval.shape
        and (tuple(lc), tuple(rc)) == ((r - 1,), (r - 1,))
        and (tuple(lb), tuple(rb)) == (lead, lead)
        and e.params.get("preferred_element_type") in (None, e.outvars[0].aval.dtype)
    )


def _allowed(e, rows: tuple) -> bool:
    """Whether equation ``e`` may be part of a region whose row axes are ``rows``."""
    name = e.primitive.name
    if name in _ELEMENTWISE or name in ("integer_pow", "pow"):
        return True
    if name == "reduce_sum":
        return tuple(e.params["axes"]) == (e.invars[0].aval.ndim - 1,)
    if name == "max":
        return _clamp_at_zero(e, rows)
    if name == "dot_general":
        return _row_dot(e)
    if name not in ("broadcast_in_dim", "reshape"):
        return False
    src, dst = tuple(e.invars[0].aval.shape), tuple(e.outvars[0].aval.shape)
    if _rows_shape(src, rows) is None or _rows_shape(dst, rows) is None:
        return False
    if name == "reshape":
        return True
    # Only numpy's broadcasts: trailing axes aligned (a feature vector, a scalar), or a
    # row statistic [*rows] or [*rows, 1] kept in place. Never a vector along a row axis.
    dims = tuple(e.params["broadcast_dimensions"])
    return dims == tuple(range(len(dst) - len(src), len(dst))) or (
        src[: len(rows)] == rows and dims == tuple(range(len(src)))
    )


def _clamp_at_zero(e, rows: tuple) -> bool:
    """Whether ``e`` is ``max(0, v)`` of a row statistic ``v`` (``[*rows]`` or
    ``[*rows, 1]``)."""
    shape = tuple(e.outvars[0].aval.shape)
    zeros = [a for a in e.invars if isinstance(a, jcore.Literal) and np.all(a.val == 0)]
    return len(e.invars) == 2 and len(zeros) == 1 and shape in (rows, (*rows, 1))


def _rows_shape(shape: tuple, rows: tuple, small: tuple | None = None):
    """``shape`` with its leading ``rows`` axes replaced by ``small`` (the evaluated
    rows); ``shape`` itself when it has no row axes (a feature vector, a scalar); None
    when it mixes the row axes otherwise (a flattening reshape)."""
    n = len(rows)
    if len(shape) >= n and shape[:n] == rows and len(shape) - n <= 1:
        return (*(small if small is not None else rows), *shape[n:])
    if len(shape) <= 1 or all(s == 1 for s in shape[:-1]):
        return shape
    return None


def _region(g: Graph, out: Any, x: Any) -> _Region | None:
    """The region between ``x`` and ``out``, or None when it holds an equation outside
    the smooth row-wise set, is too large, or does not read ``x``."""
    rows, d = tuple(x.aval.shape[:-1]), x.aval.shape[-1]
    eqns, leaves, constants, chosen, seen = set(), [], {}, {}, set()
    stack, reads_x = [out], False
    while stack:
        v = stack.pop()
        if isinstance(v, jcore.Literal) or v in seen:
            continue
        seen.add(v)
        if v is x:
            reads_x = True
            continue
        if v in g.values:
            constants[v] = np.asarray(g.values[v], np.float64)
            if not _same_over_rows(constants[v], rows):
                return None  # evaluated on the first rows only: each row must be alike
            continue
        e = g.eqn_of(v)
        if e is None:
            if not _vector_shaped(v, d):
                return None  # an input other than x and the feature vectors
            leaves.append(v)
            continue
        i = g.producer[v][0]
        if i in g.constant:  # literals only: shared, evaluated once here
            value = _constant(g, v)
            if value is None or not _same_over_rows(value, rows):
                return None
            constants[v] = value
            continue
        if e.primitive.name == "select_n":  # jnp.var's `where` on a constant dof > 0
            case = _constant_case(g, e)
            if case is None:
                return None
            eqns.add(i)
            chosen[i] = case
            stack.append(case)
            continue
        if not _allowed(e, rows) or len(eqns) >= _MAX_REGION:
            if _vector_shaped(v, d):
                leaves.append(v)  # a feature vector computed outside (1 + w, a cast)
                continue
            return None
        eqns.add(i)
        stack.extend(e.invars)
    if not reads_x or len(leaves) > 2:
        return None
    return _Region(tuple(sorted(eqns)), tuple(leaves), constants, chosen)


def _constant_case(g: Graph, e) -> Any:
    """The case a ``select_n`` takes when its predicate is a constant scalar, else None."""
    pred = e.invars[0]
    value = g.scalar(pred)
    if (
        value is None
        and isinstance(pred, jcore.Var)
        and g.producer.get(pred, (-1,))[0] in g.constant
    ):
        value = _constant(g, pred)
    if value is None or np.ndim(value) != 0:
        return None
    return e.invars[1 + int(value)]


def _vector_shaped(v: Any, d: int) -> bool:
    """Whether ``v`` is a float feature vector: ``[d]`` or ``[1, ..., 1, d]``."""
    shape = tuple(v.aval.shape)
    return (
        bool(shape)
        and shape[-1] == d
        and all(s == 1 for s in shape[:-1])
        and (J.is_float(v.aval.dtype))
    )


def _same_over_rows(c: np.ndarray, rows: tuple) -> bool:
    """Whether constant ``c`` is the same in every row (or has no row axes)."""
    n = len(rows)
    if not n or c.ndim <= 1 or c.shape[:n] != rows:
        return True
    return bool(np.all(c == c[(0,) * n]))


def _constant(g: Graph, v: Any) -> np.ndarray | None:

    c = constant_value(g, v)
    return None if c is None else np.asarray(c, np.float64)


def _evaluate(g: Graph, region: _Region, out: Any, env: dict, rows: tuple, small: tuple):
    """``out`` in float64 from ``env`` (x and the leaves), the row axes cut to ``small``."""
    vals = dict(env)
    cut = tuple(slice(0, k) for k in small)
    for v, c in region.constants.items():  # constants over the rows: their first rows
        vals[v] = c[cut] if c.shape[: len(rows)] == rows and len(rows) else c

    def read(a):
        return np.float64(a.val) if isinstance(a, jcore.Literal) else vals[a]

    for i in region.eqns:
        e = g.jaxpr.eqns[i]
        if i in region.chosen:
            vals[e.outvars[0]] = read(region.chosen[i])
            continue
        args = [read(a) for a in e.invars]
        name = e.primitive.name
        with np.errstate(all="ignore"):
            if name in _ELEMENTWISE:
                r = _ELEMENTWISE[name](*args)
            elif name == "integer_pow":
                r = args[0] ** e.params["y"]
            elif name == "pow":
                r = np.power(args[0], args[1])
            elif name == "reduce_sum":
                r = np.sum(args[0], axis=-1)
            elif name == "max":  # a clamp at zero (_clamp_at_zero), checked inactive here
                v = args[0] + args[1]  # the statistic, the other operand being 0
                r = np.where(v > 0, v, np.nan)
            elif name == "dot_general":  # a row-wise dot product (_row_dot)
                r = np.sum(args[0] * args[1], axis=-1)
            elif name == "reshape":
                r = args[0].reshape(_rows_shape(tuple(e.params["new_sizes"]), rows, small))
            else:  # broadcast_in_dim
                shape = _rows_shape(tuple(e.params["shape"]), rows, small)
                dims = tuple(e.params["broadcast_dimensions"])
                src = args[0]
                expanded = np.reshape(
                    src, [src.shape[dims.index(k)] if k in dims else 1 for k in range(len(shape))]
                )
                r = np.broadcast_to(expanded, shape)
        vals[e.outvars[0]] = np.asarray(r, np.float64)
    return vals[out]


def _layer_norm64(x, scale, bias, eps):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    y = (x - m) / np.sqrt(v + eps)
    return (y if scale is None else y * scale) + (0.0 if bias is None else bias)


def _epsilons(g: Graph, region: _Region) -> list[float]:
    """The constants the region adds (eps is one of them), and 0."""
    out = []
    for i in region.eqns:
        e = g.jaxpr.eqns[i]
        if e.primitive.name != "add":
            continue
        for a in e.invars:
            c = region.constants.get(a) if isinstance(a, jcore.Var) else g.scalar(a)
            if c is not None and np.ndim(c) == 0 and np.isfinite(c) and float(c) > 0:
                out.append(float(c))
    # 0 last: a norm without eps is recognized, then refused (the operators need eps > 0).
    return [*dict.fromkeys(out), 0.0]


@dataclasses.dataclass(frozen=True)
class NormFound:
    """A verified norm: its operator, ``x``, the scale and bias vars (or None), ``eps``."""

    op: str  # "layer_norm" or "rms_norm"
    x: Any
    scale: Any
    bias: Any
    eps: float
    plus_one: bool  # the scale is 1 + the scale var (Gemma's norms)
    region: _Region


def _rms_norm64(x, scale, bias, eps):
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return (y if scale is None else y * scale) + (0.0 if bias is None else bias)


# The norms a region is compared with, in order, by their float64 formulas.
_REFERENCES = (("layer_norm", _layer_norm64), ("rms_norm", _rms_norm64))


def _verify(
    g: Graph, out: Any, x: Any, region: _Region, seed: int, op: str, reference: Callable
) -> NormFound | None:
    """The reading of ``region`` as ``reference`` (the norm ``op``) of ``x``, if one
    agrees with it at a random point."""
    rows, d = tuple(x.aval.shape[:-1]), x.aval.shape[-1]
    small = tuple(min(r, _ROWS) for r in rows)
    rng = np.random.default_rng(seed)
    # Rows with a nonzero mean and unequal spreads, so centring and scaling both matter.
    x64 = rng.normal(size=(*small, d)) * rng.uniform(0.5, 2.0, size=(*small, 1))
    x64 = x64 + rng.uniform(-1.0, 1.0, size=(*small, 1))
    vecs = [rng.normal(size=d) for _ in region.leaves]
    env = {x: x64}
    env.update({v: u.reshape(v.aval.shape) for v, u in zip(region.leaves, vecs, strict=True)})
    got = _evaluate(g, region, out, env, rows, small)
    if got.shape != x64.shape or not np.all(np.isfinite(got)):
        return None
    roles = {0: [(None, None)], 1: [(0, None), (None, 0)], 2: [(0, 1), (1, 0)]}
    for eps in _epsilons(g, region):
        for s, b in roles[len(region.leaves)]:
            for plus_one in (False, True) if s is not None else (False,):
                w = None if s is None else vecs[s] + (1.0 if plus_one else 0.0)
                want = reference(x64, w, None if b is None else vecs[b], eps)
                scale = max(1.0, float(np.max(np.abs(want))))
                if np.allclose(got, want, rtol=_RTOL, atol=_RTOL * scale):
                    scale_var = None if s is None else region.leaves[s]
                    bias_var = None if b is None else region.leaves[b]
                    return NormFound(op, x, scale_var, bias_var, eps, plus_one, region)
    return None


def _row_sum_operands(g: Graph, out: Any) -> list:
    """Values of the anchor's shape whose rows the region upstream of ``out`` sums, in
    the order met: the candidates for ``x`` (a layer norm takes the mean of ``x``)."""
    shape, found, seen, stack = tuple(out.aval.shape), [], set(), [out]
    for _ in range(_MAX_REGION * 2):
        if not stack:
            break
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        e = g.eqn_of(v)
        if e is None or not _allowed(e, shape[:-1]):
            continue
        if e.primitive.name == "reduce_sum" and tuple(e.invars[0].aval.shape) == shape:
            for summed in _and_upcast_source(g, e.invars[0]):
                found.append(summed)  # mean(x): x
                root = squared(g, summed)
                if root is not None:
                    found.append(root)  # mean(x^2): x
        if e.primitive.name == "dot_general" and e.invars[0] is e.invars[1]:
            found.append(e.invars[0])  # einsum("td,td->t", x, x) / d: x
        stack.extend(a for a in e.invars if isinstance(a, jcore.Var))
    return list(dict.fromkeys(found))


def _and_upcast_source(g: Graph, v: Any) -> list:
    """``v``, and the value it widens when it is an upcast: ``jnp.mean`` of a bfloat16
    array sums it in float32 (``convert(x)``), while the rest of the norm reads ``x``."""
    e = g.eqn_of(v)
    if e is not None and is_upcast(e) and isinstance(e.invars[0], jcore.Var):
        return [v, e.invars[0]]
    return [v]


_NEAR = (
    "norm by structure (row sums and a root) but not (x - mean) / sqrt(var + eps) "
    "nor x / sqrt(mean(x^2) + eps)"
)


def find_norm(g: Graph, i: int):
    """A layer or RMS norm over the last axis ending at equation ``i``, verified by
    evaluation; a reason when a maximal region with a root and row sums computes
    something else."""

    eqn = g.jaxpr.eqns[i]
    if eqn.primitive.name not in ("add", "sub", "mul", "div") or len(eqn.outvars) != 1:
        return None
    out = eqn.outvars[0]
    shape = tuple(out.aval.shape)
    if not J.is_float(out.aval.dtype) or len(shape) < 1 or shape[-1] < 2:
        return None
    candidates = _row_sum_operands(g, out)
    if not candidates:
        return None
    regions = []
    for x in candidates:
        region = _region(g, out, x)
        names = () if region is None else {g.jaxpr.eqns[k].primitive.name for k in region.eqns}
        if {"sqrt", "rsqrt", "pow"} & set(names):
            regions.append((x, region))
    # A layer norm first: it is also an RMS norm of x - mean(x), a smaller stand-in.
    for op, reference in _REFERENCES:
        for x, region in regions:
            found = _verify(g, out, x, region, i, op, reference)
            if found is not None:
                return _replacement(Replacement, found, out)
    if regions and _maximal(g, out, [x for x, _ in regions]):
        return Miss(_NEAR)
    return None


def _maximal(g: Graph, out: Any, xs: list) -> bool:
    """Whether no reader of ``out`` continues a region from one of ``xs`` (the reason is
    said once, where the region ends, not at each inner equation)."""
    rows = tuple(out.aval.shape[:-1])
    for j in g.consumers(out):
        e = g.jaxpr.eqns[j]
        if not _allowed(e, rows) or tuple(e.outvars[0].aval.shape) != tuple(out.aval.shape):
            continue
        if any(_region(g, e.outvars[0], x) is not None for x in xs):
            return False
    return True


def _replacement(Replacement, found: NormFound, out: Any):
    d, dtype, eps = out.aval.shape[-1], out.aval.dtype, found.eps
    if eps <= 0:
        return None  # the operators need eps > 0; eps = 0 divides by zero at zero rows
    covered = frozenset(found.region.eqns)
    inputs = (found.x, found.scale, found.bias)
    op, plus_one = found.op, found.plus_one

    def call(x, scale, bias):
        w = np.ones(d, x.dtype) if scale is None else scale.reshape(d).astype(x.dtype)
        b = None if bias is None else bias.reshape(d).astype(x.dtype)
        if op == "layer_norm":
            return ops.layer_norm(x, 1 + w if plus_one else w, b, eps=eps).astype(dtype)
        y = ops.rms_norm(x, w, eps=eps, offset=1.0 if plus_one else 0.0)
        # Rank-explicit: the caller may run with jax_numpy_rank_promotion="raise".
        return (y if b is None else y + b.reshape((1,) * (y.ndim - 1) + (d,))).astype(dtype)

    what = "layer norm" if op == "layer_norm" else "RMS norm"
    source = f"{what} (verified by evaluation)" + (", scale 1 + g" if plus_one else "")
    return Replacement(Kind.NORM, op, source, inputs, covered, out, call)
