"""logsumexp, softmax, log_softmax: check_op, edge conventions, masks, memory, bad input."""

import functools

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

OPS = op_configs("reductions")
NAMES = ["logsumexp", "softmax", "log_softmax"]
INF = jnp.inf
MASK = jnp.array(
    [[True, False, True, True], [False, False, False, False], [True, True, False, True]]
)
X = jnp.array([[0.3, 5.0, -1.0, 2.0], [1.0, 2.0, 3.0, 4.0], [-2.0, 0.0, 9.0, 1.0]])


def test_family_is_registered():
    assert sorted(p.values[0] for p in OPS) == sorted(NAMES * 2)


@pytest.mark.parametrize("name,cfg", OPS)
@pytest.mark.parametrize("dtype", CHECK_DTYPES)
def test_check_op_random_points(name, cfg, dtype):
    random_points(name, cfg, dtype)


@pytest.mark.parametrize("name", NAMES)
# float32 edge points: `cannjax ops` runs check_op at each of them, under every config,
# for every operator (tests/test_cli.py::test_ops_self_check_passes_for_every_operator).
# These float64 sweeps are long: `make test-extended` (CI) runs them.
@pytest.mark.parametrize("dtype", [pytest.param("float64", marks=pytest.mark.extended)])
def test_check_op_edge_points(name, dtype):
    assert edge_points(name, dtype) >= 4


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", CHECK_DTYPES)
def test_check_op_random_points_with_mask(name, dtype):
    where = jax.random.bernoulli(jax.random.key(3), 0.7, (3, 5)).at[:, 0].set(True)
    for axis in (-1, 0):
        # log_softmax is -inf at masked entries, where finite differences are NaN.
        fd = name != "log_softmax"
        random_points(name, {"axis": axis, "where": where}, dtype, (0,), finite_differences=fd)


@pytest.mark.parametrize("name", sample(NAMES, every=2))
@pytest.mark.parametrize("transform", TRANSFORM_PARAMS)
def test_composes_with_transforms(name, transform):
    transform_matches_plain(name, {}, transform)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_forward(name, dtype):
    half_precision_forward(name, {}, dtype)


@pytest.mark.parametrize("name", NAMES)
def test_half_precision_accumulates_in_float32(name):
    # 4096 entries of 1 in bfloat16: a bfloat16 running sum stalls at 256; float32 does not.
    x = jnp.zeros((4096,), jnp.bfloat16)
    out = registry()[name].fn(x)
    want = registry()[name].reference(jnp.zeros((4096,), jnp.float32))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), rtol=1e-2)


# ---------------------------------------------------------------- residuals
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("masked", [False, True])
def test_residual_bytes_never_more_than_plain_jax(name, masked):
    x = rand.normal(jax.random.key(0), (64, 16))
    cfg = {"where": jax.random.bernoulli(jax.random.key(1), 0.8, (64, 16))} if masked else {}
    cfg["axis"] = -1
    ours, plain = residual_bytes(name, (x,), cfg)
    assert ours.total_bytes <= plain.total_bytes, f"ours:\n{ours}\nplain:\n{plain}"
    # Exactly what the docstrings promise (deterministic).
    full, row, mask = 64 * 16 * 4, 64 * 4, 64 * 16 if masked else 0
    want = {
        "logsumexp": full + row,  # exp(x - m) (0 where masked), 1/s per row
        "softmax": full,  # the output only
        "log_softmax": full + row + mask,  # exp(x - m), 1/s per row (+ the mask)
    }[name]
    assert ours.total_bytes == want, str(ours)
    # Residuals that are the op's own inputs stay unnamed (docs/design.md): JAX reports
    # them as arguments; every computed residual is named after the op.
    computed = {
        r.op for r in ours.rows if not r.source.startswith(("from the argument", "from a constant"))
    }
    assert computed <= {name}, str(ours)


# ---------------------------------------------------------------- edge conventions
def test_logsumexp_empty_rows_are_minus_inf_with_zero_gradient_where_plain_jax_is_nan():
    x = jnp.array([[-INF, -INF, -INF], [0.0, 1.0, -INF]])
    plain = jax.grad(lambda x: jax.nn.logsumexp(x, axis=-1).sum())(x)
    assert np.isnan(plain[0]).all()
    np.testing.assert_array_equal(cannjax.ops.logsumexp(x, axis=-1)[0], -np.inf)
    g = jax.grad(lambda x: cannjax.ops.logsumexp(x, axis=-1).sum())(x)
    np.testing.assert_array_equal(g[0], 0.0)
    np.testing.assert_allclose(g[1], jax.nn.softmax(x[1]), rtol=1e-6)
    # Fully masked row: -inf and gradient 0 as well.
    where = jnp.array([[True, True, True], [False, False, False]])
    y = cannjax.ops.logsumexp(x.at[0].set(1.0), axis=-1, where=where)
    assert y[1] == -np.inf
    g = jax.grad(lambda x: cannjax.ops.logsumexp(x, axis=-1, where=where).sum())(x.at[0].set(1.0))
    np.testing.assert_array_equal(g[1], 0.0)


def test_softmax_and_log_softmax_of_an_all_minus_inf_row_where_plain_jax_is_nan():
    x = jnp.array([[-INF, -INF, -INF], [0.0, 1.0, -INF]])
    assert np.isnan(jax.nn.softmax(x)[0]).all() and np.isnan(jax.nn.log_softmax(x)[0]).all()
    np.testing.assert_array_equal(cannjax.ops.softmax(x)[0], 0.0)
    np.testing.assert_array_equal(cannjax.ops.log_softmax(x)[0], -np.inf)
    w = jnp.array([[1.0, -2.0, 3.0], [0.5, 1.0, 2.0]])
    g = jax.grad(lambda x: (cannjax.ops.softmax(x) * w).sum())(x)
    np.testing.assert_array_equal(g[0], 0.0)
    # log_softmax: softmax taken as 0, so d(x_i - lse)/dx_i = 1 and the gradient is w.
    g = jax.grad(lambda x: (cannjax.ops.log_softmax(x) * w).sum())(x)
    np.testing.assert_array_equal(g[0], w[0])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("axis", [-1, 0])
def test_masked_entries_never_receive_gradient(name, axis):
    fn = registry()[name].fn
    mask = MASK if axis == -1 else MASK.T
    x = X if axis == -1 else X.T
    # A random cotangent that is nonzero on masked entries too.
    out_shape = jax.eval_shape(lambda x: fn(x, axis=axis, where=mask), x).shape
    w = rand.normal(jax.random.key(0), out_shape)
    g = jax.grad(lambda x: (fn(x, axis=axis, where=mask) * w).sum())(x)
    np.testing.assert_array_equal(np.asarray(g)[~np.asarray(mask)], 0.0)
    _, t = jax.jvp(lambda x: fn(x, axis=axis, where=mask), (x,), (jnp.ones_like(x),))
    assert np.isfinite(np.asarray(t)).all()
    # Fully masked row/column: value 0 (softmax), -inf (others), gradient exactly 0.
    empty = (slice(1, 2), slice(None)) if axis == -1 else (slice(None), slice(1, 2))
    np.testing.assert_array_equal(np.asarray(g)[empty], 0.0)
    out = np.asarray(fn(x, axis=axis, where=mask))
    want = 0.0 if name == "softmax" else -np.inf
    np.testing.assert_array_equal(out[empty] if name != "logsumexp" else out[1], want)


@pytest.mark.parametrize("name", NAMES)
def test_partially_minus_inf_rows_are_exact(name):
    x = jnp.array([[0.0, -INF, 1.0, -INF], [2.0, -1.0, -INF, 0.5]])
    spec = registry()[name]
    fn, ref = functools.partial(spec.fn, axis=-1), functools.partial(spec.reference, axis=-1)
    np.testing.assert_allclose(fn(x), ref(x), rtol=1e-6)
    w = rand.normal(jax.random.key(1), jax.eval_shape(fn, x).shape)
    g = jax.grad(lambda x: (fn(x) * w).sum())(x)
    # Exact gradients with p = softmax(x) (0 at the -inf entries), in float64.
    p, w64 = np.asarray(jax.nn.softmax(x), np.float64), np.asarray(w, np.float64)
    want = {
        "logsumexp": lambda: w64[:, None] * p,
        "softmax": lambda: p * (w64 - (p * w64).sum(-1, keepdims=True)),
        "log_softmax": lambda: w64 - p * w64.sum(-1, keepdims=True),
    }[name]()
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", NAMES)
def test_rows_with_plus_inf_take_the_limit_where_plain_jax_is_nan(name):
    # As the +inf entries grow together, softmax -> uniform over them: value and
    # gradient of that limit, never inf - inf.
    x = jnp.array([[1.0, INF, 2.0, -INF], [INF, INF, 0.0, 1.0]])
    p = jnp.array([[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    spec = registry()[name]
    fn, ref = functools.partial(spec.fn, axis=-1), functools.partial(spec.reference, axis=-1)
    assert np.isnan(ref(x)).any() or np.isnan(jax.grad(lambda x: ref(x).sum())(x)).any()
    want = {
        "logsumexp": jnp.array([INF, INF]),
        "softmax": p,
        "log_softmax": jnp.where(p > 0, jnp.log(p), -INF),
    }[name]
    np.testing.assert_allclose(fn(x), want, rtol=1e-6)
    w = jnp.array([[0.5, -1.0, 2.0, 0.25], [1.0, 3.0, -2.0, 0.5]])
    weights = w if name != "logsumexp" else jnp.ones(2)
    g = jax.grad(lambda x: (fn(x) * weights).sum())(x)
    assert np.isfinite(g).all(), g
    if name == "logsumexp":
        np.testing.assert_allclose(g, p)


@pytest.mark.parametrize("name", NAMES)
def test_nan_propagates(name):
    x = jnp.array([[1.0, jnp.nan, 2.0], [0.0, 1.0, 2.0]])
    fn = functools.partial(registry()[name].fn, axis=-1)
    y = np.asarray(fn(x)).reshape(2, -1)
    assert np.isnan(y[0]).all() and np.isfinite(y[1]).all()


@pytest.mark.parametrize("name", ["logsumexp", "log_softmax"])
def test_large_logits_are_exact_and_finite(name):
    x = jnp.array([[1e4, -1e4, 0.0, 1e4 - 1.0], [-1e4, -1e4 + 3.0, -1e4, -1e4]])
    x64 = np.asarray(x, np.float64)
    m = x64.max(-1, keepdims=True)
    lse = m + np.log(np.exp(x64 - m).sum(-1, keepdims=True))
    want = lse[:, 0] if name == "logsumexp" else x64 - lse
    out = registry()[name].fn(x, axis=-1)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-7, atol=1e-6)
    g = jax.grad(lambda x: registry()[name].fn(x, axis=-1).sum())(x)
    p = np.exp(x64 - lse)
    gwant = p if name == "logsumexp" else 1 - 4 * p
    np.testing.assert_allclose(np.asarray(g, np.float64), gwant, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("name", NAMES)
def test_bad_input_is_a_clear_error(name):
    fn = registry()[name].fn
    pre = rf"cannjax\.ops\.{name}: "
    arg = "a" if name == "logsumexp" else "x"
    # Integer arrays are promoted as in jax.nn (tests/test_parity.py); complex is refused
    # but by logsumexp (tests/test_logsumexp_complex.py).
    if name != "logsumexp":
        with pytest.raises(TypeError, match=pre + arg + " must be a real"):
            fn(jnp.arange(3) * 1j)
    with pytest.raises(TypeError, match=pre + arg + " must be an array or a Python scalar"):
        fn([1.0, 2.0])
    with pytest.raises(ValueError, match=pre + r"axis=2 is out of range for an input of rank 2"):
        fn(X, axis=2)
    with pytest.raises(ValueError, match=pre + r"axis=-3 is out of range"):
        jax.jit(lambda x: fn(x, axis=-3))(X)
    with pytest.raises(TypeError, match=pre + "axis must be None, an int or a tuple of ints"):
        fn(X, axis=1.5)
    with pytest.raises(ValueError, match=pre + r"axis must not repeat an axis, got \(1, -1\)"):
        fn(X, axis=(1, -1))
    if name != "logsumexp":  # logsumexp of a scalar is the scalar, as in jax.nn
        with pytest.raises(ValueError, match=pre + "x must have at least one dimension"):
            fn(1.0)
    with pytest.raises(TypeError, match=pre + "where must be a boolean array"):
        fn(X, where=jnp.ones((3, 4)))
    with pytest.raises(ValueError, match=pre + r"where must broadcast to x.shape=\(3, 4\)"):
        fn(X, where=jnp.ones((2, 4), bool))
    # A broadcastable mask is accepted.
    out = fn(X, where=jnp.array([True, False, True, True]))
    np.testing.assert_allclose(out, registry()[name].reference(X, where=MASK[0]), rtol=1e-6)


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "logsumexp"])
@pytest.mark.parametrize("shape,axis", [((3, 0), -1), ((0, 4), -1), ((3, 0), 0), ((0,), 0)])
def test_zero_size_axes_match_jax_nn(name, shape, axis):
    # A zero-size reduced axis raised "zero-size array to reduction operation max";
    # jax.nn gives [] (softmax family) and -inf (logsumexp).
    ours, theirs = getattr(cannjax.ops, name), getattr(jax.nn, name)
    x = jnp.zeros(shape)
    np.testing.assert_array_equal(ours(x, axis=axis), theirs(x, axis=axis))
    assert ours(x, axis=axis).shape == theirs(x, axis=axis).shape
    grad = lambda f: jax.grad(lambda x: f(x, axis=axis).sum())(x)  # noqa: E731
    np.testing.assert_array_equal(grad(ours), grad(theirs))
    t = jnp.ones(shape)
    tangent = jax.jvp(lambda x: ours(x, axis=axis), (x,), (t,))[1]
    if name == "logsumexp":
        # An empty row is a fully masked one: -inf with tangent 0, the documented
        # convention (jax.nn's jvp gives NaN there).
        np.testing.assert_array_equal(tangent, jnp.zeros_like(tangent))
    else:
        np.testing.assert_array_equal(
            tangent, jax.jvp(lambda x: theirs(x, axis=axis), (x,), (t,))[1]
        )
