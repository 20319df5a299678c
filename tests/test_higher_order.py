"""Every order through the operators' own rules (issue 15, finding 3), and check_op's
second-order checks catching what they should."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
from cannjax.core import OpSpec, defop
from cannjax.testing import check_op
from tests import _rng as rand

ops = cannjax.ops


# ---------------------------------------------------------------- finding 3, as reported
def test_finding_3_value_inside_value_and_grad_is_differentiated_by_the_op():
    # jacfwd of the value of value_and_grad: the gradient again, through gelu's own
    # tangent rule (plain autodiff of the forward was NaN at every entry here).
    x = jnp.array([1e20, -jnp.inf, 1.0])

    def value(x):
        return jax.value_and_grad(lambda x: ops.gelu(x).sum())(x)[0]

    got = jax.jacfwd(value)(x)
    np.testing.assert_allclose(got, jax.grad(lambda x: ops.gelu(x).sum())(x), rtol=1e-6)
    np.testing.assert_allclose(got, [1.0, 0.0, jax.grad(jax.nn.gelu)(1.0)], rtol=1e-6)


def test_finding_3_primal_output_of_a_jvp_keeps_the_mask():
    mask = jnp.array([True, False, True, True])
    f = functools.partial(ops.log_softmax, where=mask)
    x, t = jnp.array([0.5, 2.0, -1.0, 0.3]), jnp.array([1.0, 2.0, -1.0, 0.5])
    direct = jax.jvp(f, (x,), (t,))[1]
    nested = jax.jvp(lambda x: jax.jvp(f, (x,), (t,))[0], (x,), (t,))[1]
    np.testing.assert_allclose(nested, direct, rtol=1e-6)
    assert float(nested[1]) == 0.0


def test_finding_3_cross_entropy_at_inf_under_nested_differentiation():
    # Documented gradient at a +inf logit that is not the label: p - onehot = [1, -1, 0].
    logits, labels = jnp.array([[jnp.inf, 0.0, 0.0]]), jnp.array([1])
    t = jnp.ones_like(logits)

    def primal_of_jvp(z):
        return jax.jvp(lambda z: ops.softmax_cross_entropy(z, labels), (z,), (t,))[0].sum()

    np.testing.assert_array_equal(jax.grad(primal_of_jvp)(logits), [[1.0, -1.0, 0.0]])
    first = jax.grad(lambda z: ops.softmax_cross_entropy(z, labels).sum())(logits)
    np.testing.assert_array_equal(first, [[1.0, -1.0, 0.0]])


# ---------------------------------------------------------------- conventions
def test_off_diagonal_hessian_is_zero_where_the_second_derivative_is_infinite():
    # log'' = -1/x^2 overflows at 1e-30; plain autodiff fills the row with inf * 0 = NaN.
    x = jnp.array([1e-30, 2.0, 0.5])
    h = jax.hessian(lambda x: ops.log(x).sum())(x)
    assert np.isneginf(h[0, 0])
    np.testing.assert_array_equal(np.asarray(h)[~np.eye(3, dtype=bool)], 0.0)
    assert np.isnan(jax.hessian(lambda x: jnp.log(x).sum())(x)[0, 1])


@pytest.mark.parametrize("fn", ["norm", "normalize", "cosine_similarity"])
def test_zero_row_has_finite_second_derivatives(fn):
    x = jnp.array([[0.0, 0.0, 0.0], [1.0, -2.0, 2.0]])
    f = {
        "norm": lambda x: ops.norm(x).sum(),
        "normalize": lambda x: ops.normalize(x).sum(),
        "cosine_similarity": lambda x: ops.cosine_similarity(x, x[::-1]).sum(),
    }[fn]
    h = jax.hessian(f)(x)
    assert np.isfinite(np.asarray(h)).all()


def test_softmax_at_plus_inf_has_the_limit_second_derivative():
    # Two +inf logits tie: the Hessian of logsumexp is diag(p) - p p^T with p = (1/2, 1/2,
    # 0), the limit as they grow together.
    x = jnp.array([jnp.inf, jnp.inf, 0.0])
    h = jax.hessian(lambda x: ops.logsumexp(x))(x)
    p = np.array([0.5, 0.5, 0.0])
    np.testing.assert_allclose(h, np.diag(p) - np.outer(p, p), atol=1e-7)


def test_fully_masked_row_has_zero_second_derivatives():
    mask = jnp.array([[True, True, False], [False, False, False]])
    x = jnp.array([[0.3, -1.0, 2.0], [1.0, 2.0, 3.0]])
    h = jax.hessian(lambda x: ops.logsumexp(x, axis=-1, where=mask).sum())(x)
    np.testing.assert_array_equal(np.asarray(h)[1], 0.0)
    np.testing.assert_array_equal(np.asarray(h)[:, :, 1], 0.0)
    np.testing.assert_array_equal(np.asarray(h)[0, 2], 0.0)


@pytest.mark.parametrize("name", ["exp", "tanh", "gelu", "log_softmax", "layer_norm"])
def test_third_derivative_matches_plain_autodiff(name):
    spec = cannjax.core.registry()[name]
    args = spec.sample(jax.random.key(0))
    u = rand.normal(jax.random.key(1), args[0].shape)

    def third(f):
        def s(x):
            return jnp.sum(jnp.sin(f(x, *args[1:])))

        def hvp(x):
            return jax.jvp(jax.grad(s), (x,), (u,))[1]

        return jax.jvp(hvp, (args[0],), (u,))[1]

    np.testing.assert_allclose(third(spec.fn), third(spec.reference), rtol=2e-4, atol=2e-4)


def test_no_plain_autodiff_of_the_forward_under_an_outer_transform():
    # An op whose forward differs from its rules (rules of 2x, forward sin) exposes which
    # one an outer jvp differentiates: the rules, at every order.
    op = defop(
        "t_rules_win",
        forward=lambda x: (jnp.sin(x), {}),
        tangent=lambda r, t: 2 * t,
        backward=lambda r, g: (2 * g,),
    )
    x = jnp.array([0.3, 1.0])
    inner = jax.jacfwd(lambda x: jax.jvp(op, (x,), (jnp.ones_like(x),))[0])(x)
    np.testing.assert_array_equal(inner, 2 * np.eye(2))


# ---------------------------------------------------------------- check_op, second order
def _cube(name, tangent):
    op = defop(
        name,
        forward=lambda x: (x**3, {"x": x}),
        tangent=tangent,
        backward=lambda r, g: (tangent(r, g),),
    )
    return OpSpec(name=name, fn=op, reference=lambda x: x**3, sample=None, residuals={"x": ""})


X = jnp.array([0.3, -1.2, 2.0])


def test_check_op_passes_a_correct_second_order():
    check_op(_cube("t_cube", lambda r, t: 3 * r["x"] ** 2 * t), X)


def test_check_op_catches_a_wrong_second_derivative():
    # First derivative right, second derivative 0 (the residual's tangent is cut).
    bad = _cube("t_cube_sg", lambda r, t: 3 * jax.lax.stop_gradient(r["x"]) ** 2 * t)
    with pytest.raises(AssertionError, match="second order against the reference"):
        check_op(bad, X)
    with pytest.raises(AssertionError, match="second order: float64 jvp of grad"):
        check_op(bad, X, reference_grad=False)
    check_op(bad, X, second_order=False)


def test_check_op_catches_a_nan_second_derivative():
    def nan_second(r, t):
        x = r["x"]
        # Value 3x^2 t, but a derivative through sqrt(x - x) at 0: NaN.
        return (3 * x**2 + jnp.sqrt(x - x)) * t

    with pytest.raises(AssertionError, match=r"second order \(jvp of grad\) has NaN"):
        check_op(_cube("t_cube_nan", nan_second), X)
