"""Accuracy of every operator against a 50-digit truth (cannjax.testing.measure_accuracy).

The rules, on the test-sized sweep (deterministic inputs, so the figures are exact and
repeatable):

- an op with a counterpart (jax.nn, jax.scipy.special, jnp, optax) is at most
  ``SLACK_ULPS`` less accurate than it, in float32 and float64: largest relative error in
  ulps of the dtype, value and (elementwise ops) first derivative. Where both have lost
  every digit (errors of 1e15 ulps and more, in a tail where both cancel) the figures
  differ in their own rounding, so the slack is ``SLACK_ULPS`` plus ``1e-6`` of the
  counterpart's figure;
- an op without one stays within ``NO_COUNTERPART_ULPS`` (measured at most 1.5 ulps on
  both the test and the benchmark sweeps, ``docs/ops_accuracy.md``).
"""

import math

import numpy as np
import pytest

import cannjax
from cannjax._src.accuracy import _relative_error, _sweeps_of
from cannjax.core import registry
from tests._tiers import sample

SLACK_ULPS = 4.0
NO_COUNTERPART_ULPS = 4.0
DTYPES = ("float32", "float64")


def _allowed(counterpart_ulps):
    return counterpart_ulps * (1 + 1e-6) + SLACK_ULPS


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", sample(sorted(registry())))
def test_no_less_accurate_than_counterpart(op, dtype):
    for r in cannjax.testing.measure_accuracy(op, dtype):
        ours = r["cannjax"]["ulps"]
        assert math.isfinite(ours), (r["op"], dtype, r["cannjax"])
        if r["counterpart_name"] is None:
            assert ours <= NO_COUNTERPART_ULPS, (r["op"], dtype, r["cannjax"])
            continue
        assert ours <= _allowed(r["counterpart"]["ulps"]), (r["op"], dtype, r)
        if "cannjax_derivative" in r:
            d_ours = r["cannjax_derivative"]["ulps"]
            assert math.isfinite(d_ours), (r["op"], dtype, r["cannjax_derivative"])
            assert d_ours <= _allowed(r["counterpart_derivative"]["ulps"]), (r["op"], dtype, r)


def test_every_op_has_a_sweep():
    assert [op for op in registry() if not _sweeps_of(op)] == []


def test_exact_gelu_left_tail_in_float32():
    # gelu(-12.5) = -2.2e-35 is a normal float32; Phi(-12.5) alone is not far above the
    # subnormal range, and (x / 2) erfc(...) keeps the product's accuracy.
    rows = cannjax.testing.measure_accuracy(cannjax.ops.gelu, "float32")
    (r,) = [r for r in rows if r["op"] == "gelu(approximate=False)"]
    assert r["cannjax"]["ulps"] <= _allowed(r["counterpart"]["ulps"])


def test_relative_error_rules():
    f32 = "float32"
    tiny = float(np.finfo(np.float32).tiny)
    hi = np.array([1.0, 0.5 * tiny, 0.5 * tiny, 1e39, 2.0, 0.0])
    lo = np.zeros_like(hi)
    got = np.array([1.0 + 2**-23, 0.0, 0.5 * tiny, np.inf, np.nan, tiny])
    err = _relative_error(got, hi, lo, 0.0, f32)
    # one ulp; a flushed and an exact subnormal are both exact; an overflowing truth
    # wants inf; NaN is an infinite error; at a zero the floor (tiny) scales the error
    np.testing.assert_allclose(err, [2**-23, 0, 0, 0, np.inf, 1.0])
    # a floor above |true| (cancellation) measures the error against the floor
    assert _relative_error(np.array([1e-3]), np.array([0.0]), lo[:1], 10.0, f32)[0] == 1e-4


def test_bad_arguments():
    with pytest.raises(ValueError, match="measure_accuracy: dtype"):
        cannjax.testing.measure_accuracy("exp", "float16")
    with pytest.raises(ValueError, match="measure_accuracy: points"):
        cannjax.testing.measure_accuracy("exp", points="all")
    with pytest.raises(KeyError, match="no operator named"):
        cannjax.testing.measure_accuracy("not_an_op")
