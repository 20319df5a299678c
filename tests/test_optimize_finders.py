"""Every finder speaks one type (issue 46): at every equation of fuzzed spellings and
near-miss mutants of every kind, each finder of the planner returns a Replacement (of a
known Kind), a Miss (with a reason), or None: never a string, a tuple or a bare value."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import optimize_spellings as fuzz
from cannjax._src.core import rewrite as R
from cannjax._src.core.graph import Graph
from cannjax._src.optimization import rewrite
from cannjax._src.optimization.match import without_repeats
from cannjax._src.optimization.replacement import Kind, Miss, Replacement


def _graph(spelling) -> Graph:
    floats, ints, w = fuzz.arguments(spelling.kind)
    with jax.numpy_rank_promotion("allow"):
        closed = jax.make_jaxpr(lambda *a: (spelling.fn(*a) * w).sum())(*floats, *ints)
    return Graph.of(*without_repeats(*R.normalize(closed)))


def _results(spelling):
    g = _graph(spelling)
    for name, find in rewrite.FINDERS:
        for i in range(len(g.jaxpr.eqns)):
            yield name, find(g, i)


@pytest.mark.parametrize("kind", sorted(fuzz.KINDS))
def test_every_finder_returns_a_replacement_a_miss_or_none(kind):
    cases = fuzz.spellings(kind, 2, seed=3) + fuzz.mutants(kind, 1, seed=3)[:3]
    found = []
    for case in cases:
        for name, got in _results(case):
            assert got is None or isinstance(got, (Replacement, Miss)), (name, type(got))
            if isinstance(got, Replacement):
                assert isinstance(got.kind, Kind) and got.covered, name
            if isinstance(got, Miss):
                assert isinstance(got.reason, str) and got.reason, name
            found.append(got)
    assert any(isinstance(r, Replacement) for r in found)  # the spellings are found


def test_a_near_miss_is_a_miss_with_its_reason():
    # eps added outside the root: the RMS-norm finder says so, as a Miss.
    def f(x):
        return x / (jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True)) + 1e-6)

    closed = jax.make_jaxpr(f)(jnp.ones((4, 8)))
    g = Graph.of(*without_repeats(*R.normalize(closed)))
    misses = [
        got
        for name, find in rewrite.FINDERS
        for i in range(len(g.jaxpr.eqns))
        if isinstance(got := find(g, i), Miss)
    ]
    assert any("eps is added outside the root" in m.reason for m in misses), misses
