"""softmax_cross_entropy: check_op, edge conventions, invalid labels, memory, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cannjax
from tests import _rng as rand
from tests._opchecks import (
    TRANSFORM_PARAMS,
    edge_points,
    half_precision_forward,
    random_points,
    residual_bytes,
    transform_matches_plain,
)
from tests._ops import CHECK_DTYPES

NAME = "softmax_cross_entropy"
xent = cannjax.ops.softmax_cross_entropy
INF = jnp.inf


@pytest.mark.parametrize("dtype", CHECK_DTYPES)
def test_check_op_random_points(dtype):
    random_points(NAME, {}, dtype)


# float32 edge points: `cannjax ops` runs check_op at each of them, under every config,
# for every operator (tests/test_cli.py::test_ops_self_check_passes_for_every_operator).
# These float64 sweeps are long: `make test-extended` (CI) runs them.
@pytest.mark.parametrize("dtype", [pytest.param("float64", marks=pytest.mark.extended)])
def test_check_op_edge_points(dtype):
    assert edge_points(NAME, dtype) >= 3


@pytest.mark.parametrize("transform", TRANSFORM_PARAMS)
def test_composes_with_transforms(transform):
    transform_matches_plain(NAME, {}, transform)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_forward(dtype):
    half_precision_forward(NAME, {}, dtype)


def test_residual_bytes_never_more_than_plain_jax():
    logits = rand.normal(jax.random.key(0), (64, 16))
    labels = rand.randint(jax.random.key(1), (64,), 0, 16)
    ours, plain = residual_bytes(NAME, (logits, labels))
    assert ours.total_bytes <= plain.total_bytes, f"ours:\n{ours}\nplain:\n{plain}"
    # logits, labels, log(s) per row: nothing else.
    assert ours.total_bytes == 64 * 16 * 4 + 64 * 4 + 64 * 4, str(ours)
    assert {r.op for r in ours.rows} == {NAME}


def test_labels_get_no_gradient_and_logits_match_optax():
    logits = rand.normal(jax.random.key(0), (2, 3, 5))
    labels = jnp.array([[0, 4, 2], [1, 1, 3]])
    np.testing.assert_allclose(
        xent(logits, labels),
        optax.softmax_cross_entropy_with_integer_labels(logits, labels),
        rtol=1e-6,
    )
    g = jax.grad(lambda z: xent(z, labels).sum())(logits)
    want = jax.nn.softmax(logits) - jax.nn.one_hot(labels, 5)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)


def test_minus_inf_non_label_logits_are_finite_where_one_hot_plain_jax_is_nan():
    logits = jnp.array([[0.0, -INF, -INF], [-INF, 2.0, 1.0]])
    labels = jnp.array([0, 1])

    def plain(z):  # the textbook formula: -sum(onehot * log_softmax)
        return -jnp.sum(jax.nn.one_hot(labels, 3) * jax.nn.log_softmax(z), -1)

    assert np.isnan(plain(logits)).any()
    out = xent(logits, labels)
    np.testing.assert_allclose(out, [0.0, np.log1p(np.exp(-1.0))], rtol=1e-6)
    g = jax.grad(lambda z: xent(z, labels).sum())(logits)
    assert np.isfinite(g).all()
    np.testing.assert_array_equal(g[0], 0.0)
    p = 1 / (1 + np.exp(-1.0))
    np.testing.assert_allclose(g[1], [0.0, p - 1, 1 - p], rtol=1e-6)


def test_plus_inf_logits_take_the_limit():
    # Label on one of k logits at +inf: loss log(k); elsewhere +inf; gradients finite.
    x = jnp.array([[1.0, jnp.inf, 2.0], [jnp.inf, jnp.inf, 0.0], [jnp.inf, 0.0, 1.0]])
    labels = jnp.array([1, 0, 1])
    loss = cannjax.ops.softmax_cross_entropy(x, labels)
    np.testing.assert_allclose(loss, [0.0, np.log(2.0), np.inf], rtol=1e-6)
    g = jax.grad(lambda x: cannjax.ops.softmax_cross_entropy(x, labels)[:2].sum())(x)
    np.testing.assert_allclose(g, [[0, 0, 0], [-0.5, 0.5, 0], [0, 0, 0]], atol=1e-7)
    plain = optax.softmax_cross_entropy_with_integer_labels(x, labels)
    assert np.isnan(plain).any()


def test_large_logits_are_exact():
    logits = jnp.array([[1e4, -1e4, 1e4 - 1.0], [-1e4, -1e4 + 2.0, -1e4]])
    labels = jnp.array([2, 0])
    x = np.asarray(logits, np.float64)
    m = x.max(-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(-1))
    want = lse - x[[0, 1], [2, 0]]
    np.testing.assert_allclose(np.asarray(xent(logits, labels), np.float64), want, rtol=1e-6)
    g = jax.grad(lambda z: xent(z, labels).sum())(logits)
    gwant = np.exp(x - lse[:, None]) - np.eye(3)[[2, 0]]
    np.testing.assert_allclose(np.asarray(g, np.float64), gwant, rtol=1e-6, atol=1e-7)


def test_out_of_range_labels_match_optax():
    # Documented, as optax: labels in [-C, 0) count from the end; labels >= C or < -C give
    # a NaN loss (an invalid label must not pass as a finite loss) and the gradient
    # softmax(logits) (the one-hot of an invalid label is zero).
    logits = rand.normal(jax.random.key(0), (6, 3))
    labels = jnp.array([3, 7, -4, -1, -3, 1])
    out = xent(logits, labels)
    ref = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    assert np.isnan(out[:3]).all() and np.isnan(ref[:3]).all()
    np.testing.assert_allclose(out[3:], ref[3:], rtol=1e-6)
    np.testing.assert_allclose(out[3:], xent(logits[3:], jnp.array([2, 0, 1])), rtol=1e-6)
    g = jax.grad(lambda z: xent(z, labels).sum())(logits)
    gref = jax.grad(lambda z: optax.softmax_cross_entropy_with_integer_labels(z, labels).sum())(
        logits
    )
    np.testing.assert_allclose(g, gref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g[:3], jax.nn.softmax(logits[:3]), rtol=1e-5)


def test_bad_input_is_a_clear_error():
    logits = jnp.zeros((4, 3))
    pre = r"cannjax\.ops\.softmax_cross_entropy: "
    with pytest.raises(ValueError, match=pre + r"labels must have shape logits.shape\[:-1\] = "
                       r"\(4,\).*got labels.shape=\(4, 1\)"):  # fmt: skip
        xent(logits, jnp.zeros((4, 1), int))
    with pytest.raises(ValueError, match=pre + "labels must have shape"):
        jax.jit(xent)(logits, jnp.zeros((3,), int))
    with pytest.raises(TypeError, match=pre + r"labels must be an integer array, got float32\[4\]"):
        xent(logits, jnp.zeros((4,)))
    with pytest.raises(TypeError, match=pre + "logits must be a real"):
        xent(jnp.zeros((4, 3), complex), jnp.zeros((4,), int))
    with pytest.raises(ValueError, match=pre + "logits must have at least one dimension"):
        xent(1.0, jnp.zeros((), int))
