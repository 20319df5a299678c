"""Finding a known computation in a jaxpr: templates traced from the code users call.

An *idiom* (gelu, a flax layer norm, optax's cross-entropy...) is given as a template: a
Python function that computes it the way a library or a user writes it. The template is
traced to a jaxpr and matched against the user's program backward from a candidate output
equation, in two passes:

1. *loose*: primitives, operand structure and rank-relative parameters (axes, dimension
   numbers, dtypes) must agree; shapes and literal values may differ. Literals of the
   template that equal a *placeholder* value (an eps, say) capture the user's literal.
2. *exact*: the template is traced again at the avals of the user values bound to its
   inputs, with the captured values, and must then agree in every equation, parameter,
   shape, dtype and literal. A match is therefore a proof that the user's equations
   compute the template's function of those inputs.

Operands of commutative primitives may appear in either order. A match covers a set of
user equations; it is usable only when no value computed inside it is read outside it
(:meth:`Graph.private`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import core as jcore

from cannjax._src.core import jaxpr as J
from cannjax._src.core import rewrite as R
from cannjax._src.core.graph import Graph, squared, view

COMMUTATIVE = frozenset("add add_any mul max min and or xor eq ne".split())
# Parameters whose values are shapes: ignored by the loose pass (the exact pass checks them).
_SHAPE_PARAMS = frozenset("shape new_sizes slice_sizes start_indices limit_indices".split())
# Parameters that hold functions (custom_jvp rules): not comparable; the primal body is.
_FUNCTION_PARAMS = frozenset("jvp_jaxpr_fun jvp_jaxpr_thunk fwd_jaxpr_thunk bwd out_trees".split())


@dataclasses.dataclass(frozen=True)
class Template:
    """A traced template: its jaxpr graph, inputs, single output and constants."""

    graph: Graph
    invars: tuple
    outvar: Any
    consts: dict  # constvar -> value

    @classmethod
    def trace(cls, fn: Callable[..., Any], avals: Sequence[Any]) -> Template:
        # Normalized as the user's program is: jit inlined, repeats merged.
        jaxpr, lead = without_repeats(*R.normalize(J.trace(fn, avals)))
        consts = dict(zip(jaxpr.invars, lead))
        invars = tuple(jaxpr.invars[len(lead) :])
        (out,) = jaxpr.outvars
        return cls(Graph.of(jaxpr), invars, out, consts)


_NO_CSE = frozenset({"rng_bit_generator", "random_bits", "random_seed", "random_wrap"})


def without_repeats(jaxpr: jcore.Jaxpr, consts: Sequence[Any]) -> tuple[jcore.Jaxpr, tuple]:
    """``jaxpr`` with repeated equations computed once (common subexpressions).

    User code often computes a value twice (``x - x.mean(-1)`` written in two places);
    an idiom's template computes it once. Equations with the same primitive, parameters
    and operands are merged (not effectful, random or body-carrying ones), so the
    program matches the template. ``jaxpr``'s leading inputs are ``consts``.
    """
    canonical: dict = {}  # a repeated equation's outputs -> the first one's
    seen: dict = {}
    steps: list[R.Step] = []
    for eqn in jaxpr.eqns:
        operands = [canonical.get(v, v) if isinstance(v, jcore.Var) else v for v in eqn.invars]
        key = _cse_key(eqn, operands)
        if key is not None and key in seen:
            canonical.update(zip(eqn.outvars, seen[key]))
            continue
        if key is not None:
            seen[key] = eqn.outvars
        if any(o is not v for o, v in zip(operands, eqn.invars)):
            eqn = eqn.replace(invars=operands)
        steps.append(R.Bind(eqn))
    outs = tuple(canonical.get(v, v) if isinstance(v, jcore.Var) else v for v in jaxpr.outvars)
    new, new_consts = R.retrace(jaxpr.replace(outvars=list(outs)), steps)
    return new, (*new_consts, *consts)


def _cse_key(eqn, operands):
    """What makes two equations compute the same values: primitive, parameters and
    operands (``operands``: ``eqn``'s, each variable replaced by its first copy)."""
    if eqn.effects or eqn.primitive.name in _NO_CSE or J.call_body(eqn) is not None:
        return None
    if any(isinstance(p, (jcore.Jaxpr, jcore.ClosedJaxpr)) for p in eqn.params.values()):
        return None
    operands = tuple(
        ("literal", repr(v.val)) if isinstance(v, jcore.Literal) else ("value", v) for v in operands
    )
    key = (eqn.primitive, tuple(sorted(eqn.params.items())), operands)
    try:
        hash(key)
    except TypeError:
        return None
    return key


@functools.lru_cache(maxsize=4096)
def _cached_trace(fn, avals_key, statics) -> Template | None:
    avals = [jax.ShapeDtypeStruct(s, d) for s, d in avals_key]
    try:
        # Templates broadcast as their authors wrote them, whatever the caller's setting.
        with jax.numpy_rank_promotion("allow"):
            return Template.trace(functools.partial(fn, **dict(statics)), avals)
    except (TypeError, ValueError):  # shapes the template's jnp code refuses: no match
        return None


def template(fn: Callable[..., Any], avals: Sequence[Any], **statics: Any) -> Template | None:
    """The template ``fn(*inputs, **statics)`` traced at ``avals`` (cached), or None."""
    key = tuple((tuple(a.shape), np.dtype(a.dtype)) for a in avals)
    return _cached_trace(fn, key, tuple(sorted(statics.items())))


# ---------------------------------------------------------------------- comparison
def _norm(x: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return tuple(_norm(y) for y in x)
    if isinstance(x, np.generic):
        return x.item()
    return x


def _same_literal(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)


def same_jaxpr(a: jcore.Jaxpr, b: jcore.Jaxpr) -> bool:
    """Whether two jaxprs are the same program up to variable names."""
    if len(a.eqns) != len(b.eqns) or len(a.invars) != len(b.invars):
        return False
    ren = dict(zip((*a.constvars, *a.invars), (*b.constvars, *b.invars)))
    if len(a.constvars) != len(b.constvars):
        return False
    for ea, eb in zip(a.eqns, b.eqns):
        if ea.primitive is not eb.primitive or len(ea.invars) != len(eb.invars):
            return False
        for x, y in zip(ea.invars, eb.invars):
            if isinstance(x, jcore.Literal):
                if not isinstance(y, jcore.Literal) or not _same_literal(x.val, y.val):
                    return False
            elif ren.get(x) is not y:
                return False
        if not _same_params(ea.params, eb.params, exact=True):
            return False
        if [_aval_key(v.aval) for v in ea.outvars] != [_aval_key(v.aval) for v in eb.outvars]:
            return False
        ren.update(zip(ea.outvars, eb.outvars))
    return all(
        (_same_literal(x.val, y.val) if isinstance(x, jcore.Literal) else ren.get(x) is y)
        for x, y in zip(a.outvars, b.outvars)
    )


def _same_params(pa: dict, pb: dict, exact: bool) -> bool:
    if pa.keys() != pb.keys():
        return False
    for k, va in pa.items():
        vb = pb[k]
        if k in _FUNCTION_PARAMS or (not exact and k in _SHAPE_PARAMS):
            continue
        if isinstance(va, jcore.ClosedJaxpr) and isinstance(vb, jcore.ClosedJaxpr):
            ok = same_jaxpr(va.jaxpr, vb.jaxpr) and all(
                _same_literal(x, y) for x, y in zip(va.consts, vb.consts)
            )
            if exact and not ok:
                return False
            continue
        if isinstance(va, jcore.Jaxpr) and isinstance(vb, jcore.Jaxpr):
            if exact and not same_jaxpr(va, vb):
                return False
            continue
        try:
            a, b = _norm(va), _norm(vb)
            if a != b and not (isinstance(a, float) and isinstance(b, float) and a != a and b != b):
                return False
        except (TypeError, ValueError):  # incomparable values are not known to be equal
            return False
    return True


def _aval_key(aval: Any) -> tuple:
    return (tuple(getattr(aval, "shape", ())), str(getattr(aval, "dtype", "")))


# ---------------------------------------------------------------------- matching
@dataclasses.dataclass
class Match:
    """A template matched in a user graph."""

    inputs: tuple  # user atoms bound to the template's inputs (None when unused)
    covered: frozenset  # user eqn indices
    captured: dict  # placeholder value -> user literal value


def _aligned(a: tuple, b: tuple) -> bool:
    """Equal axis maps under broadcasting (missing leading axes are broadcast ones)."""
    n = max(len(a), len(b))
    return (None,) * (n - len(a)) + tuple(a) == (None,) * (n - len(b)) + tuple(b)


class _State:
    __slots__ = ("vars", "eqns", "captured", "views")

    def __init__(self, vars_=None, eqns=None, captured=None, views=None):
        self.vars = vars_ or {}
        self.eqns = eqns or {}
        self.captured = captured or {}
        self.views = views or set()  # user view equations of values computed inside

    def copy(self) -> _State:
        return _State(dict(self.vars), dict(self.eqns), dict(self.captured), set(self.views))


def match(
    t: Template,
    g: Graph,
    out: Any,
    *,
    exact: bool,
    placeholders: Sequence[float] = (),
) -> Match | None:
    """Matches template ``t`` in graph ``g`` with its output at user var ``out``."""
    tin = set(t.invars)
    holders = [np.float64(p) for p in placeholders]

    def same_value(tv, uv) -> bool:
        u = g.scalar(uv)
        return u is not None and _same_literal(tv, u)

    def m(tv, uv, st: _State) -> _State | None:
        if isinstance(tv, jcore.Literal) or tv in t.consts:
            tval = tv.val if isinstance(tv, jcore.Literal) else t.consts[tv]
            if not exact and g.scalar(uv) is not None and np.ndim(tval) == 0:
                for p in holders:
                    if np.isclose(np.float64(tval), p, rtol=1e-6, atol=0):
                        st.captured[float(p)] = float(g.scalar(uv))
                        return st
                return st  # loose: literal values are checked by the exact pass
            return st if same_value(tval, uv) else None
        if tv in st.vars:
            bound = st.vars[tv]
            if bound is uv:
                return st
            if isinstance(bound, jcore.Literal) and isinstance(uv, jcore.Literal):
                return st if _same_literal(bound.val, uv.val) else None
            return None
        if tv in tin:
            if exact and _aval_key(tv.aval) != _aval_key(uv.aval):
                return None
            st.vars[tv] = uv
            return st
        ti, tk = t.graph.producer[tv]
        if not isinstance(uv, jcore.Var) or uv not in g.producer:
            return None
        ui, uk = g.producer[uv]
        if tk != uk:
            return None
        if ti in st.eqns:
            return st if st.eqns[ti] == ui else None
        # Two template equations may meet one user equation: the user's program, merged
        # of repeats at its own sizes, can share what the template (at other sizes)
        # computes twice; both compute the same function of matched operands.
        te, ue = t.graph.jaxpr.eqns[ti], g.jaxpr.eqns[ui]
        tbase, ubase = squared(t.graph, tv), squared(g, uv)
        if tbase is not None and ubase is not None:
            # x**2, jnp.square(x), x * x and pow(x, 2) are one function of x.
            ka, kb = _aval_key(tv.aval), _aval_key(uv.aval)
            if ka[1] != kb[1] or len(ka[0]) != len(kb[0]) or (exact and ka != kb):
                return None
            st.eqns[ti] = ui
            st.vars[tv] = uv
            return m(tbase, ubase, st)
        if te.primitive is not ue.primitive or len(te.invars) != len(ue.invars):
            return None
        if len(te.outvars) != len(ue.outvars) or not _same_params(te.params, ue.params, exact):
            return None
        for a, b in zip(te.outvars, ue.outvars):
            ka, kb = _aval_key(a.aval), _aval_key(b.aval)
            if ka[1] != kb[1] or len(ka[0]) != len(kb[0]) or (exact and ka != kb):
                return None
        st.eqns[ti] = ui
        for a, b in zip(te.outvars, ue.outvars):
            st.vars[a] = b
        orders = [list(ue.invars)]
        if te.primitive.name in COMMUTATIVE and len(ue.invars) == 2:
            orders.append(list(reversed(ue.invars)))
        operand = m_view if te.primitive.name in J.POINTWISE else m
        for order in orders:
            trial = st.copy() if len(orders) > 1 else st
            for a, b in zip(te.invars, order):
                trial = operand(a, b, trial)
                if trial is None:
                    break
            if trial is not None:
                return trial
        return None

    def m_view(tv, uv, st: _State) -> _State | None:
        # An operand of an elementwise equation: broadcasts and unit reshapes before it are
        # views. Views of matching sources with the same axis map hold the same values
        # there (x * s, x * s[None] and x * s.reshape(1, -1) are one function).
        tsrc, tmap, tchain = view(t.graph, tv)
        usrc, umap, uchain = view(g, uv)
        # An input of the template binds to a source of the user's only at its own rank
        # (else the exact pass would trace the template at another shape).
        same_rank = not (isinstance(tsrc, jcore.Var) and tsrc in tin) or np.ndim(tsrc.aval) == len(
            getattr(getattr(usrc, "aval", None), "shape", ())
        )
        if (tchain or uchain) and same_rank and _aligned(tmap, umap):
            viewed = m(tsrc, usrc, st.copy())
            if viewed is not None:
                if isinstance(tsrc, jcore.Var) and tsrc not in tin:  # a view of an inner value
                    viewed.views.update(uchain)
                return viewed
        return m(tv, uv, st)

    st = m(t.outvar, out, _State())
    if st is None or not st.eqns:
        return None
    inputs = tuple(st.vars.get(v) for v in t.invars)
    covered = (frozenset(st.eqns.values()) | frozenset(st.views)) - g.constant
    return Match(inputs, covered, st.captured)
