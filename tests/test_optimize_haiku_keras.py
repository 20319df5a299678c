"""cannjax.optimize on the norms of two libraries outside benchmarks/corpus, written as
their users write them: dm-haiku's ``hk.LayerNorm`` and ``hk.RMSNorm``, and Keras 3's
``keras.layers.LayerNormalization`` and ``RMSNormalization`` on the JAX backend. Keras
folds the scale into the inverse deviation and takes the variance as ``E[x^2] - E[x]^2``;
haiku broadcasts the mean square before adding eps. Neither spelling is a template: the
norm finder that verifies by evaluation (cannjax/_src/optimization/finders/verified_norm.py) finds
them."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import haiku as hk  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import cannjax  # noqa: E402
from tests import _rng as rand  # noqa: E402


@pytest.fixture(autouse=True)
def _library_broadcasting():
    # Keras broadcasts its [d] scale against [..., d] implicitly.
    with jax.numpy_rank_promotion("allow"):
        yield


X = rand.normal(jax.random.key(0), (2, 5, 16)) * 1.5 + 0.5
W = rand.normal(jax.random.key(1), (2, 5, 16))


def _check(loss, params, op):
    report = cannjax.inspect.optimize(loss, params, X)
    assert [r.op for r in report.replaced if r.kind == "norm"] == ([op] if op else []), str(report)
    opt = cannjax.optimize(loss)
    got = jax.jit(jax.value_and_grad(opt, (0, 1)))(params, X)
    want = jax.jit(jax.value_and_grad(loss, (0, 1)))(params, X)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        scale = max(1.0, float(jnp.max(jnp.abs(b))))
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6 * scale)


def _haiku(make):
    f = hk.without_apply_rng(hk.transform(lambda x: make()(x)))
    params = f.init(jax.random.key(2), X)
    params = jax.tree.map(lambda p: p + 0.1 * rand.normal(jax.random.key(3), p.shape), params)
    return (lambda p, x: jnp.sum(f.apply(p, x) * W)), params


@pytest.mark.parametrize("scale,offset", [(True, True), (True, False), (False, False)])
def test_haiku_layer_norm(scale, offset):
    loss, params = _haiku(lambda: hk.LayerNorm(-1, create_scale=scale, create_offset=offset))
    _check(loss, params, "layer_norm")


def test_haiku_rms_norm():
    loss, params = _haiku(lambda: hk.RMSNorm(-1))
    _check(loss, params, "rms_norm")


def _keras(layer_class=None, **options):
    """``(loss, params)`` of a Keras layer (``LayerNormalization`` by default) called as
    its stateless users call it, its weights moved off their initial values."""
    layer = (layer_class or keras.layers.LayerNormalization)(epsilon=1e-5, **options)
    layer.build(X.shape)
    params = [
        v.value + 0.1 * rand.normal(jax.random.key(4), v.shape) for v in layer.trainable_variables
    ]

    def loss(params, x):
        y, _ = layer.stateless_call(params, [], x)
        return jnp.sum(y * W)

    return loss, params


@pytest.mark.parametrize("options", [{}, {"center": False}, {"scale": False}], ids=str)
def test_keras_layer_normalization(options):
    _check(*_keras(**options), "layer_norm")


def test_keras_rms_normalization():
    _check(*_keras(keras.layers.RMSNormalization), "rms_norm")


@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")
def test_keras_rms_scaling_is_left_alone():
    # Keras' (deprecated) rms_scaling divides x, uncentred, by its standard deviation:
    # neither a layer norm nor an RMS norm, so nothing may stand in for it.
    _check(*_keras(rms_scaling=True), None)
