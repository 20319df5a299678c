"""optimize's layer-norm finder by evaluation (cannjax/_src/optimization/finders/verified_norm.py):
spellings no template lists are found, the result equals the original in value, gradient
and JVP, and near-miss mutants, which compute something else, are left alone and said."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import cannjax
from tests import _rng as rand

EPS = 1e-5


@pytest.fixture(autouse=True)
def _library_broadcasting():
    # Model code broadcasts the [d] scale against [..., d] implicitly; so do these.
    with jax.numpy_rank_promotion("allow"):
        yield


D = 16
X = rand.normal(jax.random.key(0), (3, 5, D)) * 1.5 + 0.3
G = 1.0 + 0.1 * rand.normal(jax.random.key(1), (D,))
B = 0.1 * rand.normal(jax.random.key(2), (D,))
W = rand.normal(jax.random.key(3), (3, 5, D))


def _mean(x):
    return jnp.mean(x, -1, keepdims=True)


def _folded(var):
    """The scale folded into the inverse deviation, the mean subtracted after."""

    def f(x, g, b):
        m = _mean(x)
        r = lax.rsqrt(var(x, m) + EPS) * g
        return x * r + (b - m * r)

    return f


def _moments(x, m):  # E[x^2] - E[x]^2
    return _mean(x * x) - m**2


def _centred(x, m):
    return _mean(jnp.square(x - m))


SPELLINGS = {
    "folded, E[x^2] - E[x]^2": _folded(_moments),
    "folded, jnp.var": _folded(lambda x, m: jnp.var(x, -1, keepdims=True)),
    "folded, E[(x - m)^2]": _folded(_centred),
    "pow(v + eps, -1/2)": lambda x, g, b: (
        (x - _mean(x)) * jnp.power(_centred(x, _mean(x)) + EPS, -0.5) * g + b
    ),
    "divided by sqrt, scale first": lambda x, g, b: (
        g * (x - _mean(x)) / jnp.sqrt(_moments(x, _mean(x)) + EPS) + b
    ),
    "sum / d statistics": lambda x, g, b: _folded(
        lambda x, m: jnp.sum(x * x, -1, keepdims=True) / D - m * m
    )(x, g, b),
    "bias added to the shifted mean": lambda x, g, b: (
        x * (lax.rsqrt(jnp.var(x, -1, keepdims=True) + EPS) * g)
        - (_mean(x) * lax.rsqrt(jnp.var(x, -1, keepdims=True) + EPS) * g - b)
    ),
    "scale 1 + g": lambda x, g, b: _folded(_centred)(x, 1 + g, b),
    "no bias": lambda x, g, b: _folded(_moments)(x, g, jnp.zeros_like(b)) + 0 * b,
    "no scale, no bias": lambda x, g, b: (
        (x - _mean(x)) * lax.rsqrt(_moments(x, _mean(x)) + EPS) + 0 * (g + b)
    ),
    "std squared, pow(v + eps, -1/2), scale on the left": lambda x, g, b: (
        g
        * (
            (x - jnp.average(x, -1, keepdims=True))
            * (jnp.std(x, -1, keepdims=True) ** 2 + EPS) ** -0.5
        )
        + b
    ),
    "inputs cast with astype(float32)": lambda x, g, b: _folded(_moments)(
        x.astype(jnp.float32), g.astype(jnp.float32), b
    ),
}

MUTANTS = {
    "eps outside the root": lambda x, g, b: (
        (x - _mean(x)) / (jnp.sqrt(_centred(x, _mean(x))) + EPS) * g + b
    ),
    "variance not centred": lambda x, g, b: (x - _mean(x)) * lax.rsqrt(_mean(x * x) + EPS) * g + b,
    "unbiased variance (d - 1)": lambda x, g, b: (
        (x - _mean(x)) * lax.rsqrt(jnp.var(x, -1, keepdims=True, ddof=1) + EPS) * g + b
    ),
    "mean over another axis": lambda x, g, b: (
        (x - jnp.mean(x, -2, keepdims=True)) * lax.rsqrt(jnp.var(x, -2, keepdims=True) + EPS) * g
        + b
    ),
    "scale missing from the mean term": lambda x, g, b: (
        x * (lax.rsqrt(jnp.var(x, -1, keepdims=True) + EPS) * g)
        + (b - _mean(x) * lax.rsqrt(jnp.var(x, -1, keepdims=True) + EPS))
    ),
    "scale inside the root": lambda x, g, b: (
        (x - _mean(x)) * lax.rsqrt(_centred(x, _mean(x)) * g + EPS) + b
    ),
}


def _loss(f):
    return lambda x, g, b: jnp.sum(f(x, g, b) * W)


def _layer_norms(report):
    return [r for r in report.replaced if r.op == "layer_norm"]


def _check_equal(loss, opt, args=(X, G, B)):
    """Value, gradient and JVP of ``opt`` equal ``loss``'s, in float64 (1e-6 relative)."""
    with jax.enable_x64(True):
        a64 = [jnp.asarray(a, jnp.float64) for a in args]
        got = jax.value_and_grad(opt, (0, 1, 2))(*a64)
        want = jax.value_and_grad(loss, (0, 1, 2))(*a64)
        t = [jnp.ones_like(a) for a in a64]
        jvps = [jax.jvp(fn, a64, t)[1] for fn in (opt, loss)]
    for u, v in zip(jax.tree.leaves((got, jvps[0])), jax.tree.leaves((want, jvps[1]))):
        scale = max(1.0, float(jnp.max(jnp.abs(v))))
        np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_found_however_written_and_equal(name):
    loss = _loss(SPELLINGS[name])
    report = cannjax.inspect.optimize(loss, X, G, B)
    found = _layer_norms(report)
    assert len(found) == 1, str(report)
    _check_equal(loss, cannjax.optimize(loss))


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutants_are_left_alone_and_said(name):
    loss = _loss(MUTANTS[name])
    report = cannjax.inspect.optimize(loss, X, G, B)
    assert _layer_norms(report) == [], str(report)
    _check_equal(loss, cannjax.optimize(loss))


def test_a_region_that_is_not_a_layer_norm_says_why():
    loss = _loss(MUTANTS["eps outside the root"])
    report = cannjax.inspect.optimize(loss, X, G, B)
    said = [r for r in report.left if "not (x - mean) / sqrt(var + eps)" in r.source]
    assert len(said) == 1, str(report)


def test_the_found_norm_keeps_fewer_residuals():
    # The folded spelling keeps x, the centred terms and the products for its backward;
    # ops.layer_norm keeps x and two row statistics.
    loss = _loss(SPELLINGS["folded, E[x^2] - E[x]^2"])
    before = cannjax.inspect.residuals(loss, X, G, B).total_bytes
    after = cannjax.inspect.residuals(cannjax.optimize(loss), X, G, B).total_bytes
    assert after < before


def test_a_constant_that_differs_between_rows_is_not_sampled_away():
    # The finder evaluates the first two rows of each leading axis; a closed-over
    # constant that is 1 there and 0 below must not make `ln(x) * mask` read as ln(x).
    mask = np.ones(X.shape, np.float32)
    mask[2:] = 0.0
    norm = SPELLINGS["folded, jnp.var"]
    loss = _loss(lambda x, g, b: norm(x, g, b) * mask)
    opt = cannjax.optimize(loss)
    _check_equal(loss, opt)
    # The norm itself is still found, with the mask multiplied after it.
    assert len(_layer_norms(cannjax.inspect.optimize(loss, X, G, B))) == 1
    np.testing.assert_allclose(opt(X, G, B), loss(X, G, B), rtol=1e-5)


def _einsum_rms(d):
    def norm(x, g, b):
        ms = jnp.einsum("btd,btd->bt", x, x)[..., None] / d
        return x / jnp.sqrt(ms + EPS) * g + 0 * b

    return norm


def test_a_mean_square_written_as_a_row_wise_einsum_is_an_rms_norm():
    # A row-wise dot product x . x is a sum of squares: read by the evaluating finder.
    loss = _loss(_einsum_rms(D))
    report = cannjax.inspect.optimize(loss, X, G, B)
    assert [r.op for r in report.replaced if r.kind == "norm"] == ["rms_norm"], str(report)
    _check_equal(loss, cannjax.optimize(loss))


def test_a_row_wise_einsum_over_d_minus_1_is_not_an_rms_norm():
    loss = _loss(_einsum_rms(D - 1))
    report = cannjax.inspect.optimize(loss, X, G, B)
    assert not [r for r in report.replaced if r.kind == "norm"], str(report)
    _check_equal(loss, cannjax.optimize(loss))
