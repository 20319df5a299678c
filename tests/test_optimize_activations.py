"""optimize finds GELU and SiLU by what they compute (optimization/finders/activation.py):
spelled out in any order, with float32 constants, through erf or erfc, sigmoid or tanh; near
misses stay; values and gradients equal."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import cannjax
from cannjax._src.optimization.finders import activation
from tests import _rng as rand

C = math.sqrt(2 / math.pi)

FOUND = {
    "gelu, x*x*x and float32 digits": (
        lambda x: x * 0.5 * (1.0 + jnp.tanh(0.7978845608 * (x + 0.044715 * x * x * x))),
        "gelu, tanh form",
    ),
    "gelu as x sigmoid(2z)": (
        lambda x: x * jax.nn.sigmoid(2 * C * (x + 0.044715 * x**3)),
        "gelu, tanh form",
    ),
    "gelu through erf": (lambda x: 0.5 * x * (1 + lax.erf(x / np.sqrt(2))), "gelu, erf form"),
    "gelu through erfc": (
        lambda x: x * 0.5 * jax.scipy.special.erfc(-x / math.sqrt(2.0)),
        "gelu, erf form",
    ),
    "silu as x / (1 + exp(-x))": (lambda x: x / (1 + jnp.exp(-x)), "silu"),
    "silu through tanh": (lambda x: x * 0.5 * (1 + jnp.tanh(x / 2)), "silu"),
    # jnp.logaddexp and jax.nn.softplus are custom_jvp calls, read as the function
    "silu through logaddexp": (lambda x: x * jnp.exp(-jnp.logaddexp(0.0, -x)), "silu"),
    "silu through softplus": (lambda x: x * jnp.exp(-jax.nn.softplus(-x)), "silu"),
}

NEAR = {
    "gelu with 0.04": lambda x: 0.5 * x * (1 + jnp.tanh(C * (x + 0.04 * x**3))),
    "gelu with sqrt(2/pi) to five digits": lambda x: (
        0.5 * x * (1 + jnp.tanh(0.79788 * (x + 0.044715 * x**3)))
    ),
    "erf without 1/sqrt 2": lambda x: 0.5 * x * (1 + lax.erf(x)),
    "x sigmoid(2x)": lambda x: x / (1 + jnp.exp(-2 * x)),
    "x / (1 + exp(x))": lambda x: x / (1 + jnp.exp(x)),
    "x exp(-logaddexp(0, -2x))": lambda x: x * jnp.exp(-jnp.logaddexp(0.0, -2 * x)),
}


def _x(shape=(4, 8, 16), dtype=jnp.float32):
    return (2 * rand.normal(jax.random.key(0), shape, jnp.float32)).astype(dtype)


def _loss(f):
    w = rand.normal(jax.random.key(1), (4, 8, 16), jnp.float32)
    return lambda x: jnp.sum(f(x).astype(jnp.float32) * w)


@pytest.mark.parametrize("name", sorted(FOUND))
def test_spelled_out_activations_are_found_with_equal_gradients(name):
    f, what = FOUND[name]
    loss = _loss(f)
    report = cannjax.inspect.optimize(loss, _x())
    (row,) = report.replaced
    assert row.source == f"{what} (verified by evaluation)" and not report.left
    (v, g), (v0, g0) = (
        jax.value_and_grad(cannjax.optimize(loss))(_x()),
        jax.value_and_grad(loss)(_x()),
    )
    np.testing.assert_allclose(v, v0, rtol=1e-5)
    np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(g0))))


@pytest.mark.parametrize("name", sorted(NEAR))
def test_near_misses_are_left_alone(name):
    report = cannjax.inspect.optimize(_loss(NEAR[name]), _x())
    assert not [r for r in report.replaced if r.op in ("gelu", "silu")], report


def test_a_bf16_activation_computed_in_float32_is_found():
    def f(h):  # a mixed-precision model: upcast, the activation, back to bf16
        x = h.astype(jnp.float32)
        return (x / (1 + jnp.exp(-x))).astype(jnp.bfloat16)

    loss = _loss(f)
    x = _x(dtype=jnp.bfloat16)
    (row,) = cannjax.inspect.optimize(loss, x).replaced
    assert row.op == "silu"
    g, g0 = jax.grad(cannjax.optimize(loss))(x), jax.grad(loss)(x)
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(g, np.float32), np.asarray(g0, np.float32), rtol=2e-2, atol=2e-2
    )


@pytest.mark.parametrize("name", ["silu as x / (1 + exp(-x))", "gelu through erf"])
def test_an_activation_of_a_dense_layer_is_found_at_its_sum(name):
    # x is h = a @ w + b, itself computed by elementwise algebra from two arrays.
    f, what = FOUND[name]
    w = rand.normal(jax.random.key(2), (16, 16), jnp.float32) * 0.3
    b = rand.normal(jax.random.key(3), (16,), jnp.float32)

    def loss(a, w, b):
        return jnp.sum(f(a @ w + b[None, None, :]) ** 2)

    report = cannjax.inspect.optimize(loss, _x(), w, b)
    sources = [r.source for r in report.replaced]
    assert f"{what} (verified by evaluation)" in sources, report
    assert "linear" in [r.op for r in report.replaced], report
    g = jax.grad(cannjax.optimize(loss), (0, 1, 2))(_x(), w, b)
    g0 = jax.grad(loss, (0, 1, 2))(_x(), w, b)
    for u, v in zip(g, g0):
        np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(v))))


def test_an_activation_of_two_arrays_is_not_a_function_of_one():
    # x * sigmoid(y): the region reads two arrays, so it is no activation of either.
    def loss(x, y):
        return jnp.sum(x / (1 + jnp.exp(-y)))

    report = cannjax.inspect.optimize(loss, _x(), _x() + 1)
    assert not [r for r in report.replaced if r.op == "silu"]


def test_the_tolerance_takes_float32_constants_and_rejects_a_fifth_digit():
    points = activation._points(0)
    want = activation._gelu_tanh64(points)

    def gelu(c, k):
        return 0.5 * points * (1 + np.tanh(c * (points + k * points**3)))

    def err(got):
        return np.max(np.abs(got - want)) / max(1.0, np.max(np.abs(want)))

    as_f32 = gelu(float(np.float32(0.7978845608)), float(np.float32(0.044715)))
    assert err(as_f32) < activation._RTOL < err(gelu(0.79788, 0.044715))
