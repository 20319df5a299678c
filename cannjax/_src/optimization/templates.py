"""Idioms found by template: a candidate of :mod:`idioms`, traced at the anchor's rank
and dtype, matched loosely (sizes ignored), then traced again at the matched shapes and
matched exactly (:mod:`match`). Leaf module: it imports no finder.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from cannjax._src.core.graph import Graph, upstream
from cannjax._src.optimization import idioms
from cannjax._src.optimization.match import Match, match, template
from cannjax._src.optimization.replacement import Miss, Replacement


def canonical(aval):
    """``aval`` with small distinct sizes (units kept): the loose pass ignores sizes, so
    templates traced at these serve every anchor of the same rank and dtype (one trace)."""
    shape = tuple(1 if d == 1 else 2 + k for k, d in enumerate(aval.shape))
    return jax.ShapeDtypeStruct(shape, aval.dtype)


@dataclasses.dataclass(frozen=True)
class IdiomMatch:
    """A candidate of an idiom matched exactly: its statics, with the placeholders
    replaced by the user's values, and the match."""

    candidate: idioms.Candidate
    statics: dict
    match: Match


def match_idiom(g: Graph, i: int, idiom: idioms.Idiom) -> IdiomMatch | Miss | None:
    """The first candidate of ``idiom`` matched exactly with its output at eqn ``i``; a
    :class:`Miss` when one matched loosely but failed the exact pass; else None."""
    eqn = g.jaxpr.eqns[i]
    if eqn.primitive.name not in idiom.anchors or len(eqn.outvars) != 1:
        return None
    if idiom.near is not None and not upstream(g, i, idiom.near.primitives, idiom.near.depth):
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
            near = Miss(f"looks like {cand.source} but differs in shapes, dtypes or constants")
            continue
        return IdiomMatch(cand, statics, exact)
    return near


def template_finder(idiom: idioms.Idiom):
    """A finder ``find(graph, eqn) -> Replacement | Miss | None`` of ``idiom``'s templates."""

    def find(g: Graph, i: int) -> Replacement | Miss | None:
        found = match_idiom(g, i, idiom)
        if not isinstance(found, IdiomMatch):
            return found
        cand, statics, m = found.candidate, found.statics, found.match
        call = functools.partial(cand.replace, **statics) if statics else cand.replace
        return Replacement(
            idiom.name, idiom.op, cand.source, m.inputs, m.covered, g.jaxpr.eqns[i].outvars[0], call
        )

    return find
