"""Which cases of a long sweep run in make test; make test-extended (CI) runs the others.

Sweeps that repeat one cross-cutting check over every operator (dtype keeping, degenerate
shapes, transforms, exports, accuracy, shard_map) are the bulk of make test's time.
make test keeps every ``every``-th operator of each (a fixed, sorted subset, so a
failure reproduces); each operator is still checked against its reference and float64
finite differences in make test (``test_check_op_random_points``), and CI runs the full
sweeps with ``make test-extended``.
"""

import pytest
from _pytest.mark.structures import ParameterSet


def sample(values, every: int = 3) -> list:
    """``values`` as pytest parameters: positions 0, every, 2 * every... as given, the
    others marked ``extended`` (marks already on a value are kept)."""
    out = []
    for i, v in enumerate(values):
        if i % every == 0:
            out.append(v)
        elif isinstance(v, ParameterSet):
            out.append(pytest.param(*v.values, marks=(*v.marks, pytest.mark.extended), id=v.id))
        else:
            out.append(pytest.param(v, marks=pytest.mark.extended))
    return out
