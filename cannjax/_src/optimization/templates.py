"""Idioms found by template: a candidate of :mod:`idioms`, traced at the anchor's rank
and dtype, matched loosely (sizes ignored), then traced again at the matched shapes and
matched exactly (:mod:`match`). Leaf module: it imports no finder.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax._src import core as jcore

from cannjax._src.optimization import idioms
from cannjax._src.optimization.match import Graph, match, template
from cannjax._src.optimization.replacement import Replacement


def canonical(aval):
    """``aval`` with small distinct sizes (units kept): the loose pass ignores sizes, so
    templates traced at these serve every anchor of the same rank and dtype (one trace)."""
    shape = tuple(1 if d == 1 else 2 + k for k, d in enumerate(aval.shape))
    return jax.ShapeDtypeStruct(shape, aval.dtype)


def near_upstream(g: Graph, i: int, names: frozenset, depth: int) -> bool:
    """Whether an equation named in ``names`` is at most ``depth`` steps upstream of ``i``."""
    frontier, seen = {i}, set()
    for _ in range(depth + 1):
        if any(g.jaxpr.eqns[j].primitive.name in names for j in frontier):
            return True
        seen |= frontier
        frontier = {
            g.producer[v][0]
            for j in frontier
            for v in g.jaxpr.eqns[j].invars
            if isinstance(v, jcore.Var) and v in g.producer
        } - seen
    return False


def match_idiom(g: Graph, i: int, idiom: idioms.Idiom):
    """The first candidate of ``idiom`` matched exactly with its output at eqn ``i``.

    Returns ``(candidate, statics, match)``, or a string saying why a loose match failed
    the exact pass, or None.
    """
    eqn = g.jaxpr.eqns[i]
    if eqn.primitive.name not in idiom.anchors or len(eqn.outvars) != 1:
        return None
    if idiom.near is not None and not near_upstream(g, i, idiom.near.primitives, idiom.near.depth):
        return None
    out = eqn.outvars[0]
    near = None
    for cand in idiom.candidates(canonical(out.aval)):
        statics = dict(cand.statics)
        t = template(cand.fn, cand.avals, **statics)
        if t is None:
            continue
        te = t.graph.eqn_of(t.outvar)
        if te is None or te.primitive is not eqn.primitive:
            continue
        held = {k: v for k, v in statics.items() if v in idioms.PLACEHOLDERS}
        loose = match(t, g, out, exact=False, placeholders=list(held.values()))
        if loose is None:
            continue
        if any(float(np.float64(v)) not in loose.captured for v in held.values()):
            continue
        statics.update({k: loose.captured[float(np.float64(v))] for k, v in held.items()})
        avals = [
            u.aval if u is not None else a for u, a in zip(loose.inputs, cand.avals, strict=True)
        ]
        t2 = template(cand.fn, avals, **statics)
        exact = match(t2, g, out, exact=True) if t2 is not None else None
        if exact is None:
            near = f"looks like {cand.source} but differs in shapes, dtypes or constants"
            continue
        return cand, statics, exact
    return near


def template_finder(idiom: idioms.Idiom):
    """A finder ``find(graph, eqn) -> Replacement | str | None`` of ``idiom``'s templates."""

    def find(g: Graph, i: int):
        found = match_idiom(g, i, idiom)
        if not isinstance(found, tuple):
            return found
        cand, statics, m = found
        call = functools.partial(cand.replace, **statics) if statics else cand.replace
        return Replacement(
            idiom.name, idiom.op, cand.source, m.inputs, m.covered, g.jaxpr.eqns[i].outvars[0], call
        )

    return find
