"""optimize's structural RMS-norm finder (cannjax/_src/optimization/finders/rms_norm.py): the norm
is found however it is spelled (the spellings of the libraries in benchmarks/corpus),
the result equals the original in value and gradient, and near misses, which compute
something else, are left alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import cannjax
from tests import _rng as rand

EPS = 1e-6


@pytest.fixture(autouse=True)
def _library_broadcasting():
    # The libraries broadcast the [d] scale against [..., d] implicitly; so do these.
    with jax.numpy_rank_promotion("allow"):
        yield


X = rand.normal(jax.random.key(0), (3, 5, 16))
W = 1.0 + 0.1 * rand.normal(jax.random.key(1), (16,))
Y = rand.normal(jax.random.key(2), (3, 5, 16))


def _ms(x):
    return jnp.mean(jnp.square(x), -1, keepdims=True)


EPS_CONST = jnp.float32(EPS)  # a closed-over constant, not a literal (penzai)

SPELLINGS = {
    # transformers' Flax RMSNorm: power, sqrt, a division, the weight on the left.
    "hf": lambda x, w: w * (x / jnp.sqrt(jnp.power(x, 2).mean(-1, keepdims=True) + EPS)),
    "lax.pow": lambda x, w: x * lax.rsqrt(jnp.mean(lax.pow(x, 2.0), -1, keepdims=True) + EPS) * w,
    "x * x, sum / d": lambda x, w: (
        x * lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) / x.shape[-1] + EPS) * w
    ),
    "sum * (1 / d)": lambda x, w: (
        x * lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) * (1.0 / x.shape[-1]) + EPS) * w
    ),
    "1 / sqrt": lambda x, w: x * (1.0 / jnp.sqrt(_ms(x) + EPS)) * w,
    # keras-hub: the reciprocal as a power of the root.
    "sqrt ** -1": lambda x, w: x * jnp.sqrt(_ms(x) + EPS) ** -1 * w,
    "closed-over eps": lambda x, w: x * lax.rsqrt(_ms(x) + EPS_CONST) * w,
    # Gemma: the scale is 1 + w, added before or after the broadcast.
    "(1 + w)": lambda x, w: x * lax.rsqrt(_ms(x) + EPS) * (1 + w),
    "1 + broadcast w": lambda x, w: (
        x * lax.rsqrt(_ms(x) + EPS) * (1 + jnp.broadcast_to(w, x.shape))
    ),
    "no scale": lambda x, w: x * lax.rsqrt(_ms(x) + EPS) + 0 * w,
    # penzai: the scale as a dot_general without contraction, then a transpose.
    "dot_general scale": lambda x, w: jnp.transpose(
        lax.dot_general(x * lax.rsqrt(_ms(x) + EPS), w, (((), ()), ((2,), (0,)))), (1, 2, 0)
    ),
    # named axes: the features first, reduced there, then moved last.
    "features first": lambda x, w: (
        jnp.transpose(jnp.moveaxis(x, -1, 0), (1, 2, 0))
        * lax.rsqrt(jnp.mean(jnp.square(jnp.moveaxis(x, -1, 0)), 0)[..., None] + EPS)
        * w
    ),
}


def _optimized(f):
    loss = lambda x, w: jnp.sum(jnp.sin(f(x, w)))  # noqa: E731
    return loss, cannjax.optimize(loss)


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_found_however_spelled_and_equal(name):
    loss, opt = _optimized(SPELLINGS[name])
    report = cannjax.inspect.optimize(loss, X, W)
    norms = [r for r in report.replaced if r.kind == "norm"]
    assert [r.op for r in norms] == ["rms_norm"], str(report)
    got = jax.jit(jax.value_and_grad(opt, (0, 1)))(X, W)
    want = jax.jit(jax.value_and_grad(loss, (0, 1)))(X, W)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


NEAR_MISSES = {
    "eps outside the root": lambda x, w: x / (jnp.sqrt(_ms(x)) + EPS) * w,
    "mean over another axis": lambda x, w: (
        x * lax.rsqrt(jnp.mean(jnp.square(x), -2, keepdims=True) + EPS) * w
    ),
    "divided by d - 1": lambda x, w: (
        x * lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) / (x.shape[-1] - 1) + EPS) * w
    ),
    "another tensor's squares": lambda x, w: x * lax.rsqrt(_ms(Y) + EPS) * w,
    "the root, not its inverse": lambda x, w: x * jnp.sqrt(_ms(x) + EPS) * w,
    "a negative eps": lambda x, w: x * lax.rsqrt(_ms(x) + 1.0 - 1e-6 - 1.0) * w,
    "x twice": lambda x, w: x * x * lax.rsqrt(_ms(x) + EPS) * w,
}


# What the report says of each near miss, after "RMS norm (x / sqrt(mean(x^2) + eps)) but".
SAID = {
    "eps outside the root": "eps is added outside the root",
    "mean over another axis": "the statistic is not the mean of x^2 over the features",
    "divided by d - 1": "the statistic is not the mean of x^2 over the features",
    "another tensor's squares": "the product holds x other than once, or more factors",
    "the root, not its inverse": "x is multiplied by the root of its statistic, not its inverse",
    "a negative eps": "the root's argument is not mean(x^2) + eps",
    "x twice": "the product holds x other than once, or more factors",
}


@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_near_misses_are_left_alone_and_said_why(name):
    loss, opt = _optimized(NEAR_MISSES[name])
    report = cannjax.inspect.optimize(loss, X, W)
    assert not [r for r in report.replaced if r.op == "rms_norm"], str(report)
    said = {r.source for r in report.left if r.source.startswith("RMS norm")}
    assert len(said) == 1 and SAID[name] in next(iter(said)), str(report)
    np.testing.assert_allclose(jax.jit(opt)(X, W), jax.jit(loss)(X, W), rtol=1e-6)


def test_a_factor_that_is_not_a_feature_scale_stays_outside_the_norm():
    # x * rsqrt(...) is an RMS norm; the factor over rows after it is not its scale.
    loss, opt = _optimized(lambda x, w: x * lax.rsqrt(_ms(x) + EPS) * x[..., :1] + 0 * w)
    rows = [r for r in cannjax.inspect.optimize(loss, X, W).replaced if r.kind == "norm"]
    assert [r.source for r in rows] == ["x / rms(x) (structural)"]
    np.testing.assert_allclose(jax.jit(opt)(X, W), jax.jit(loss)(X, W), rtol=1e-6)


def test_a_scanned_norm_counts_once_per_layer():
    ws = jnp.stack([W, W * 0.5, W * 2.0])

    def loss(x, ws):
        def layer(h, w):
            return h + SPELLINGS["hf"](h, w), None

        return jnp.sum(lax.scan(layer, x, ws)[0])

    rows = [r for r in cannjax.inspect.optimize(loss, X, ws).replaced if r.kind == "norm"]
    assert [(r.op, r.runs) for r in rows] == [("rms_norm", 3)]
