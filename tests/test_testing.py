"""check_op catches what it should: wrong backward, wrong tangent, NaN, wrong value, and
refuses checks that cannot fail (a short expected_grad, an infinite tolerance)."""

import math

import jax.numpy as jnp
import pytest

import cannjax
from cannjax.core import OpSpec, defop
from cannjax.testing import check_op

ops = cannjax.ops


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


# ---------------------------------------------------------------- strict pairing
Y2, X2 = jnp.array([1.0, -2.0, 0.5]), jnp.array([3.0, 1.0, -4.0])
R2 = X2**2 + Y2**2
DY, DX = X2 / R2, -Y2 / R2  # d atan2(y, x) / dy and / dx


def test_checks_every_expected_gradient():
    check_op(ops.arctan2, Y2, X2, expected_grad=(DY, DX))
    with pytest.raises(AssertionError, match="gradient against expected failed"):
        check_op(ops.arctan2, Y2, X2, expected_grad=(DY, 1.01 * DX))


def test_refuses_an_expected_grad_of_the_wrong_length():
    msg = (
        r"check_op\(arctan2\): expected_grad has 1 gradient\(s\) but the operator has 2 "
        r"differentiable argument\(s\) \(positions \(0, 1\)\)"
    )
    with pytest.raises(ValueError, match=msg):
        check_op(ops.arctan2, Y2, X2, expected_grad=(DY,))
    with pytest.raises(ValueError, match="expected_grad has 3 gradient"):
        check_op(ops.arctan2, Y2, X2, expected_grad=(DY, DX, DX))
    with pytest.raises(TypeError, match="expected_grad must be a tuple"):
        check_op(ops.arctan2, Y2, X2, expected_grad=DY)
    with pytest.raises(ValueError, match=r"expected_value has 2 array\(s\) but the operator"):
        check_op(ops.arctan2, Y2, X2, expected_value=(DY, DX))


@pytest.mark.parametrize("tol", [{"atol": math.inf}, {"rtol": math.inf}, {"atol": math.nan},
                                 {"rtol": -1e-3}])  # fmt: skip
def test_refuses_a_tolerance_that_cannot_fail(tol):
    with pytest.raises(ValueError, match=r"check_op\(tanh\): [ra]tol must be finite and >= 0, got"):
        check_op(ops.tanh, X, **tol)


def test_explicit_tolerances_are_used():
    ok = _spec("t_tol", _fwd, lambda r, t: jnp.cos(r["x"]) * t, lambda r, g: (jnp.cos(r["x"]) * g,))
    near = jnp.cos(X) * (1 + 1e-4)
    check_op(ok, X, expected_grad=(near,), rtol=1e-3)
    with pytest.raises(AssertionError, match="gradient against expected"):
        check_op(ok, X, expected_grad=(near,))


def _xlogx_fwd(x):
    return jnp.where(x == 0, 0.0, x * jnp.log(x)), {"x": x}


def _xlogx_grad(r, g):
    d = jnp.log(r["x"]) + 1  # -inf at 0
    return jnp.where(g == 0, 0.0, g * d)


def _xlogx_ref(x):
    return jnp.where(x == 0, 0.0, x * jnp.log(jnp.where(x == 0, 1.0, x)))


def test_forward_against_reverse_at_an_infinite_derivative():
    # At x = 0 the derivative is -inf: <J u, w> is not a number, so the Jacobians of
    # both modes are compared instead; a tangent that disagrees is caught there.
    x = jnp.array([0.0, 0.5, 2.0])
    ok = _spec("t_xlogx", _xlogx_fwd, _xlogx_grad, lambda r, g: (_xlogx_grad(r, g),), _xlogx_ref)
    want = jnp.array([-jnp.inf, jnp.log(0.5) + 1, jnp.log(2.0) + 1])
    check_op(ok, x, finite_differences=False, reference_grad=False, expected_grad=(want,))
    bad = _spec(
        "t_xlogx_bad", _xlogx_fwd, lambda r, t: 1.01 * _xlogx_grad(r, t),
        lambda r, g: (_xlogx_grad(r, g),), _xlogx_ref,
    )  # fmt: skip
    with pytest.raises(AssertionError, match=r"forward against reverse mode \(Jacobians\) failed"):
        check_op(bad, x, finite_differences=False, reference_grad=False, expected_grad=(want,))
