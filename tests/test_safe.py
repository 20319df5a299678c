"""Safe-gradient ops: check_op, the NaN fixes against plain JAX, memory, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
from cannjax.core import registry
from tests import _rng as rand
from tests._opchecks import (
    TRANSFORM_PARAMS,
    edge_points,
    half_precision_forward,
    random_points,
    residual_bytes,
    transform_matches_plain,
)
from tests._ops import CHECK_DTYPES, op_configs
from tests._tiers import sample

OPS = op_configs("safe")
NAMES = ["norm", "normalize", "cosine_similarity", "xlogy", "entropy", "arctan2"]
ops = cannjax.ops


def test_family_is_registered():
    assert sorted({p.values[0] for p in OPS}) == sorted(NAMES)


@pytest.mark.parametrize("name,cfg", OPS)
@pytest.mark.parametrize("dtype", CHECK_DTYPES)
def test_check_op_random_points(name, cfg, dtype):
    random_points(name, cfg, dtype, seeds=(0, 1) if not cfg else (0,))


@pytest.mark.parametrize("name", NAMES)
# float32 edge points: `cannjax ops` runs check_op at each of them, under every config,
# for every operator (tests/test_cli.py::test_ops_self_check_passes_for_every_operator).
# These float64 sweeps are long: `make test-extended` (CI) runs them.
@pytest.mark.parametrize("dtype", [pytest.param("float64", marks=pytest.mark.extended)])
def test_check_op_edge_points(name, dtype):
    assert edge_points(name, dtype) >= 2


@pytest.mark.parametrize("name", sample(NAMES, every=2))
@pytest.mark.parametrize("transform", TRANSFORM_PARAMS)
def test_composes_with_transforms(name, transform):
    transform_matches_plain(name, {}, transform)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_forward(name, dtype):
    half_precision_forward(name, {}, dtype)


# ---------------------------------------------------------------- residuals
X = rand.normal(jax.random.key(0), (64, 16))
Y = rand.uniform(jax.random.key(1), (64, 16), minval=0.1, maxval=2.0)
FULL, ROW = 64 * 16 * 4, 64 * 4
RESIDUALS = {  # args, differentiated argnums, exact residual bytes (as documented)
    "norm": ((X,), 0, FULL + ROW),  # x, |x|
    "normalize": ((X,), 0, FULL + ROW),  # output, |x|
    "cosine_similarity": ((X, Y), (0, 1), 2 * FULL + 3 * ROW),  # a, b, |a|, |b|, c
    "xlogy": ((X, Y), (0, 1), 2 * FULL),  # x, y
    "entropy": ((Y,), 0, FULL),  # p
    "arctan2": ((X, Y), (0, 1), 2 * FULL),  # y, x
}


@pytest.mark.parametrize("name", NAMES)
def test_residual_bytes_never_more_than_plain_jax(name):
    args, argnums, want = RESIDUALS[name]
    ours, plain = residual_bytes(name, args, argnums=argnums)
    assert ours.total_bytes <= plain.total_bytes, f"ours:\n{ours}\nplain:\n{plain}"
    assert ours.total_bytes == want, str(ours)
    # Residuals that are the op's own inputs stay unnamed (docs/design.md): JAX reports
    # them as arguments; every computed residual is named after the op.
    computed = {
        r.op for r in ours.rows if not r.source.startswith(("from the argument", "from a constant"))
    }
    assert computed <= {name}, str(ours)


# ---------------------------------------------------------------- NaN fixes vs plain JAX
def _grads(f, *args):
    return jax.grad(lambda *a: jnp.sum(f(*a)), argnums=tuple(range(len(args))))(*args)


def test_norm_at_zero():
    x = jnp.zeros((2, 3)).at[1].set(jnp.array([3.0, 4.0, 0.0]))
    assert np.isnan(_grads(lambda x: jnp.linalg.norm(x, axis=-1), x)[0][0]).all()
    np.testing.assert_array_equal(ops.norm(x), [0.0, 5.0])
    (g,) = _grads(ops.norm, x)
    np.testing.assert_array_equal(g[0], 0.0)
    np.testing.assert_allclose(g[1], [0.6, 0.8, 0.0], rtol=1e-6)


def test_normalize_at_zero():
    x = jnp.zeros((1, 3))
    ref = registry()["normalize"].reference
    assert np.isnan(_grads(ref, x)[0]).all()
    np.testing.assert_array_equal(ops.normalize(x), 0.0)
    (g,) = _grads(ops.normalize, x)
    np.testing.assert_allclose(g, 1e12, rtol=1e-6)  # d(x / eps)/dx
    (g,) = _grads(lambda x: ops.normalize(x, eps=0.5), x)
    np.testing.assert_allclose(g, 2.0, rtol=1e-6)


def test_cosine_similarity_with_a_zero_vector():
    a, b = jnp.zeros((1, 3)), jnp.array([[1.0, -2.0, 2.0]])
    ref = registry()["cosine_similarity"].reference
    assert np.isnan(_grads(ref, a, b)[0]).all()
    np.testing.assert_array_equal(ops.cosine_similarity(a, b), [0.0])
    ga, gb = _grads(ops.cosine_similarity, a, b)
    np.testing.assert_allclose(ga, b / (1e-8 * 3.0), rtol=1e-6)
    np.testing.assert_array_equal(gb, 0.0)
    ga, gb = _grads(ops.cosine_similarity, a, a)
    np.testing.assert_array_equal(ga, 0.0)
    np.testing.assert_array_equal(gb, 0.0)


def test_arctan2_at_the_origin():
    z = jnp.zeros(3)
    assert np.isnan(_grads(jnp.arctan2, z, z)[0]).all()
    np.testing.assert_array_equal(ops.arctan2(z, z), 0.0)
    gy, gx = _grads(ops.arctan2, z, z)
    np.testing.assert_array_equal(gy, 0.0)
    np.testing.assert_array_equal(gx, 0.0)
    # Signed zeros follow IEEE, as jnp.arctan2; the gradient is still 0.
    assert float(ops.arctan2(0.0, -0.0)) == pytest.approx(np.pi)
    assert jax.grad(ops.arctan2, argnums=1)(0.0, -0.0) == 0.0


def test_arctan2_at_infinite_inputs_keeps_the_value_and_gives_gradient_zero():
    inf = jnp.inf
    y = jnp.array([inf, inf, 1.0, -1.0, -inf, inf, jnp.nan])
    x = jnp.array([inf, 1.0, inf, -inf, -inf, 0.0, 1.0])
    np.testing.assert_array_equal(ops.arctan2(y, x), jnp.arctan2(y, x))
    plain = _grads(jnp.arctan2, y[:6], x[:6])
    assert np.isnan(np.concatenate(plain)).any()  # the check can fail: plain gives NaN
    gy, gx = _grads(ops.arctan2, y, x)
    np.testing.assert_array_equal(gy[:6], 0.0)
    np.testing.assert_array_equal(gx[:6], 0.0)
    assert np.isnan(gy[6]) and np.isnan(gx[6])  # NaN in, NaN out
    tangent = jax.jvp(ops.arctan2, (y[:6], x[:6]), (jnp.ones(6), jnp.ones(6)))[1]
    np.testing.assert_array_equal(tangent, 0.0)


def test_arctan2_gradient_neither_overflows_nor_underflows():
    y = x = jnp.array([1e-30, 1e20])
    gy, gx = _grads(ops.arctan2, y, x)
    np.testing.assert_allclose(gy, [0.5e30, 0.5e-20], rtol=1e-6)
    np.testing.assert_allclose(gx, [-0.5e30, -0.5e-20], rtol=1e-6)


def test_xlogy_at_zero():
    x = jnp.zeros(4)
    y = jnp.array([0.0, 1.0, 5.0, jnp.inf])
    np.testing.assert_array_equal(ops.xlogy(x, y), 0.0)
    plain = _grads(jax.scipy.special.xlogy, x, y)
    assert np.isnan(plain[1][0])
    gx, gy = _grads(ops.xlogy, x, y)
    np.testing.assert_allclose(gx, [-np.inf, 0.0, np.log(5.0), np.inf], rtol=1e-6)
    np.testing.assert_array_equal(gy, 0.0)
    # A zero cotangent times the infinite derivative is 0, not NaN.
    _, vjp = jax.vjp(ops.xlogy, x, y)
    gx, gy = vjp(jnp.zeros(4))
    np.testing.assert_array_equal(gx, 0.0)
    np.testing.assert_array_equal(gy, 0.0)
    _, t = jax.jvp(ops.xlogy, (x, y), (jnp.zeros(4), jnp.ones(4)))
    np.testing.assert_array_equal(t, 0.0)


def test_entropy_gradients_are_never_nan():
    p = jnp.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]])
    ref = registry()["entropy"].reference
    assert np.isnan(_grads(ref, p)[0]).any()
    np.testing.assert_allclose(ops.entropy(p), [0.0, np.log(2.0)], rtol=1e-6)
    (g,) = _grads(ops.entropy, p)
    assert not np.isnan(g).any()
    np.testing.assert_array_equal(np.asarray(g)[np.asarray(p) == 0], np.inf)
    np.testing.assert_allclose(g[0, 0], -1.0)
    np.testing.assert_allclose(g[1, :2], np.log(2.0) - 1, rtol=1e-6)
    # Zero cotangent on a row with zeros: 0, not NaN; under vmap too.
    _, vjp = jax.vjp(ops.entropy, p)
    np.testing.assert_array_equal(vjp(jnp.array([0.0, 1.0]))[0][0], 0.0)
    gv = jax.vmap(jax.grad(ops.entropy))(p)
    assert not np.isnan(gv).any()


def test_binary_ops_broadcast_like_jnp():
    # Numpy broadcasting, rank promotion included (done explicitly, so it works under
    # jax_numpy_rank_promotion="raise", which this suite sets).
    a = rand.normal(jax.random.key(0), (4, 3))
    b = jnp.array([0.5, 1.0, 2.0])
    bb = jnp.broadcast_to(b, a.shape)
    np.testing.assert_allclose(ops.xlogy(a, b), jax.scipy.special.xlogy(a, bb), rtol=1e-6)
    np.testing.assert_allclose(ops.arctan2(a, b), jnp.arctan2(a, bb), rtol=1e-6)
    ref = registry()["cosine_similarity"].reference
    np.testing.assert_allclose(ops.cosine_similarity(a, b), ref(a, bb), rtol=1e-6)
    # The gradient of the broadcast argument is summed, as in jnp.
    g = jax.grad(lambda b: ops.arctan2(a, b).sum())(b)
    gref = jax.grad(lambda b: jnp.arctan2(a, jnp.broadcast_to(b, a.shape)).sum())(b)
    np.testing.assert_allclose(g, gref, rtol=1e-5)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("name", ["norm", "normalize", "entropy"])
def test_unary_bad_input(name):
    fn = registry()[name].fn
    arg = "p" if name == "entropy" else "x"
    pre = rf"cannjax\.ops\.{name}: "
    with pytest.raises(TypeError, match=pre + f"{arg} must be a real"):
        fn(jnp.arange(3) * 1j)
    with pytest.raises(ValueError, match=pre + r"axis=1 is out of range for an input of rank 1"):
        fn(jnp.ones(3), axis=1)
    with pytest.raises(ValueError, match=pre + f"{arg} must have at least one dimension"):
        fn(1.0)


@pytest.mark.parametrize("name,names", [("xlogy", "x,y"), ("arctan2", "y,x"),
                                        ("cosine_similarity", "a,b")])  # fmt: skip
def test_binary_bad_input(name, names):
    fn = registry()[name].fn
    first, second = names.split(",")
    pre = rf"cannjax\.ops\.{name}: "
    with pytest.raises(
        ValueError,
        match=pre + rf"{first} and {second} must have broadcast-compatible shapes, got "
        rf"{first}.shape=\(3,\) and {second}.shape=\(4,\)",
    ):
        fn(jnp.ones(3), jnp.ones(4))
    with pytest.raises(TypeError, match=pre + f"{second} must be a real"):
        fn(jnp.ones(3), jnp.arange(3) * 1j)


def test_eps_and_axis_validation():
    with pytest.raises(ValueError, match=r"cannjax\.ops\.normalize: eps must be a positive"):
        ops.normalize(jnp.ones(3), eps=0.0)
    with pytest.raises(ValueError, match=r"cannjax\.ops\.cosine_similarity: eps must be"):
        ops.cosine_similarity(jnp.ones(3), jnp.ones(3), eps=-1.0)
    with pytest.raises(ValueError, match=r"cannjax\.ops\.cosine_similarity: axis=2 is out"):
        ops.cosine_similarity(jnp.ones((2, 3)), jnp.ones(3), axis=2)
    with pytest.raises(ValueError, match=r"cannjax\.ops\.cosine_similarity: a and b must have"):
        ops.cosine_similarity(1.0, 2.0)
