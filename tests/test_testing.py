"""check_op catches what it should: wrong backward, wrong tangent, NaN, wrong value."""

import jax.numpy as jnp
import pytest

from cannjax.core import OpSpec, defop
from cannjax.testing import check_op


def _spec(name, forward, tangent, backward, reference=jnp.sin):
    op = defop(name, forward=forward, tangent=tangent, backward=backward)
    return OpSpec(name=name, fn=op, reference=reference, sample=None, residuals={"x": ""})


def _fwd(x):
    return jnp.sin(x), {"x": x}


X = jnp.array([0.3, -1.2, 2.0])


def test_passes_a_correct_op():
    ok = _spec("t_ok", _fwd, lambda r, t: jnp.cos(r["x"]) * t, lambda r, g: (jnp.cos(r["x"]) * g,))
    check_op(ok, X)


def test_catches_a_wrong_backward():
    bad = _spec(
        "t_bwd", _fwd, lambda r, t: jnp.cos(r["x"]) * t, lambda r, g: (1.01 * jnp.cos(r["x"]) * g,)
    )
    with pytest.raises(AssertionError, match="gradient against reference failed"):
        check_op(bad, X)
    with pytest.raises(AssertionError, match="forward against reverse"):
        check_op(bad, X, reference_grad=False)


def test_catches_a_wrong_tangent():
    bad = _spec(
        "t_tan", _fwd, lambda r, t: -jnp.cos(r["x"]) * t, lambda r, g: (jnp.cos(r["x"]) * g,)
    )
    with pytest.raises(AssertionError, match="finite differences failed"):
        check_op(bad, X)


def test_catches_a_nan_gradient_and_a_wrong_value():
    nan = _spec("t_nan", _fwd, lambda r, t: t, lambda r, g: (g * jnp.nan,))
    with pytest.raises(AssertionError, match="gradient has NaN"):
        check_op(nan, X)
    wrong = _spec("t_val", lambda x: (jnp.cos(x), {"x": x}), lambda r, t: t, lambda r, g: (g,))
    with pytest.raises(AssertionError, match=r"value against reference failed: max abs error"):
        check_op(wrong, X)


def test_catches_a_wrong_expected_gradient():
    ok = _spec("t_exp", _fwd, lambda r, t: jnp.cos(r["x"]) * t, lambda r, g: (jnp.cos(r["x"]) * g,))
    with pytest.raises(AssertionError, match="gradient against expected"):
        check_op(ok, X, expected_grad=(jnp.ones(3),))
