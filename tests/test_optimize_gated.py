"""optimize's gated-MLP finder (cannjax/_src/optimization/finders/gated_mlp.py): SwiGLU and GeGLU
blocks as the libraries write them become one swiglu / geglu, equal in value and
gradient; blocks that are not gated MLPs of one x are left to the other finders."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
from tests import _rng as rand

D, F = 16, 24
RTOL, ATOL = 2e-5, 2e-6
_k = jax.random.split(jax.random.key(5), 5)
X = rand.normal(_k[0], (2, 7, D))
WG = 0.3 * rand.normal(_k[1], (D, F))
WU = 0.3 * rand.normal(_k[2], (D, F))
WD = 0.3 * rand.normal(_k[3], (F, D))
Y = rand.normal(_k[4], (2, 7, D))


def llama(x, wg, wu, wd):  # transformers / penzai: silu(gate) * up, then down
    return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def sigmoid_spelled(x, wg, wu, wd):  # the up projection first, x * sigmoid(x) by hand
    a = x @ wg
    return ((x @ wu) * (a * jax.nn.sigmoid(a))) @ wd


def out_in_weights(x, wg, wu, wd):  # haliax: weights stored [out, in]
    wg_t, wu_t, wd_t = wg.T, wu.T, wd.T
    h = jax.nn.silu(jnp.einsum("btd,fd->btf", x, wg_t)) * jnp.einsum("btd,fd->btf", x, wu_t)
    return jnp.einsum("btf,df->btd", h, wd_t)


def gemma(x, wg, wu, wd):  # GeGLU, tanh gelu
    return (jax.nn.gelu(x @ wg, approximate=True) * (x @ wu)) @ wd


def gelu_erf(x, wg, wu, wd):
    return (jax.nn.gelu(x @ wg, approximate=False) * (x @ wu)) @ wd


def equinox_vmapped(x, wg, wu, wd):  # eqx.nn.Linear per token ([out, in] weights) under vmap
    g, u, d = wg.T, wu.T, wd.T
    return jax.vmap(jax.vmap(lambda t: d @ (jax.nn.silu(g @ t) * (u @ t))))(x)


def equinox_vmapped_in_out(x, wg, wu, wd):  # the same with [in, out] weights: t @ w
    return jax.vmap(lambda s: jax.vmap(lambda t: (jax.nn.silu(t @ wg) * (t @ wu)) @ wd)(s))(x)


def silu_by_evaluation(x, wg, wu, wd):  # a silu no template has: a / (1 + exp(-a))
    a = x @ wg
    return ((a / (1.0 + jnp.exp(-a))) * (x @ wu)) @ wd


def gelu_by_evaluation(x, wg, wu, wd):  # the erf gelu through erfc: 0.5 a erfc(-a / sqrt 2)
    a = x @ wg
    return (0.5 * a * jax.scipy.special.erfc(-a / np.sqrt(2.0)) * (x @ wu)) @ wd


FORMS = {
    "llama": (llama, "swiglu", "silu("),
    "silu verified by evaluation": (silu_by_evaluation, "swiglu", "silu("),
    "erf gelu verified by evaluation": (gelu_by_evaluation, "geglu", "gelu (erf)("),
    "sigmoid spelled": (sigmoid_spelled, "swiglu", "silu("),
    "[out, in] weights": (out_in_weights, "swiglu", "silu("),
    "gemma": (gemma, "geglu", "gelu("),
    "gelu erf": (gelu_erf, "geglu", "gelu (erf)("),
    "equinox vmapped": (equinox_vmapped, "swiglu", "silu("),
    "vmapped, [in, out] weights": (equinox_vmapped_in_out, "swiglu", "silu("),
}


def _loss(f):
    return lambda x, wg, wu, wd: jnp.sum(f(x, wg, wu, wd) * Y)


def _check_equal(loss):
    args = (X, WG, WU, WD)
    got = jax.jit(jax.value_and_grad(cannjax.optimize(loss), (0, 1, 2, 3)))(*args)
    want = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))(*args)
    np.testing.assert_allclose(got[0], want[0], RTOL, ATOL)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, RTOL, ATOL)


@pytest.mark.parametrize("name", sorted(FORMS))
def test_found_as_one_operator_and_equal(name):
    f, op, source = FORMS[name]
    loss = _loss(f)
    report = cannjax.inspect.optimize(loss, X, WG, WU, WD)
    gated = [r for r in report.replaced if r.kind == "gated"]
    assert [r.op for r in gated] == [op], str(report)
    assert gated[0].source.startswith(source), gated[0].source
    assert report.counts() == {"gated": 1}, str(report)
    _check_equal(loss)


# ------------------------------------------------------------------ near misses
def two_inputs(x, wg, wu, wd):  # gate and up read different x: not one block
    return (jax.nn.silu(x @ wg) * ((x * 2.0) @ wu)) @ wd


def relu_gate(x, wg, wu, wd):  # no gated operator for relu: three dense and a relu
    return (jax.nn.relu(x @ wg) * (x @ wu)) @ wd


def gate_read_twice(x, wg, wu, wd):  # the gate's activation is read again
    g = jax.nn.silu(x @ wg)
    return (g * (x @ wu)) @ wd + jnp.sum(g)


def vmapped_two_inputs(x, wg, wu, wd):  # features-leading, up reads another x
    g, u, d = wg.T, wu.T, wd.T
    return jax.vmap(jax.vmap(lambda t: d @ (jax.nn.silu(g @ t) * (u @ (2.0 * t)))))(x)


@pytest.mark.parametrize(
    "f",
    [two_inputs, relu_gate, gate_read_twice, vmapped_two_inputs],
)
def test_other_blocks_are_not_gated(f):
    loss = _loss(f)
    report = cannjax.inspect.optimize(loss, X, WG, WU, WD)
    assert "gated" not in report.counts(), str(report)
    _check_equal(loss)
