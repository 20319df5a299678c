"""Every elementwise operator passes check_op, saves one residual, and is stable."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
from cannjax import ops
from cannjax.core import registry
from cannjax.inspect import residuals
from tests._ops import (
    CHECK_DTYPES,
    check_edge_points,
    check_half_forward,
    check_random_points,
    op_configs,
)

OPS = op_configs("elementwise")


@pytest.mark.parametrize("name,cfg", OPS)
@pytest.mark.parametrize("dtype", CHECK_DTYPES)
def test_check_op_random_points(name, cfg, dtype):
    check_random_points(name, cfg, dtype, seeds=(0, 1))


@pytest.mark.parametrize("name,cfg", OPS)
# float32 edge points: `cannjax ops` runs check_op at each of them, under every config,
# for every operator (tests/test_cli.py::test_ops_self_check_passes_for_every_operator).
# These float64 sweeps are long: `make test-extended` (CI) runs them, as for reductions.
@pytest.mark.parametrize("dtype", [pytest.param("float64", marks=pytest.mark.extended)])
def test_check_op_edge_points(name, cfg, dtype):
    check_edge_points(name, cfg, dtype)


@pytest.mark.parametrize("name,cfg", OPS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_forward(name, cfg, dtype):
    check_half_forward(name, cfg, dtype)


@pytest.mark.parametrize("name,cfg", OPS)
def test_half_precision_value_is_the_float32_value_rounded_once(name, cfg):
    # Computed in float32 and rounded once: XLA:CPU would otherwise round every
    # intermediate to bfloat16 (slower, and a rounding error per elementwise step).
    spec = registry()[name]
    (x,) = spec.sample(jax.random.key(0))
    xb = jnp.asarray(x, jnp.float32).astype(jnp.bfloat16)
    got = jax.jit(lambda x: spec.fn(x, **cfg))(xb)
    want = jax.jit(lambda x: spec.fn(x, **cfg))(xb.astype(jnp.float32)).astype(jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("name,cfg", OPS)
def test_one_residual_never_more_than_plain_jax(name, cfg):
    spec = registry()[name]
    (x,) = spec.sample(jax.random.key(0))
    x = jnp.broadcast_to(x.ravel()[:4], (64, 4)) + 0.0  # a sizeable array
    ours = residuals(lambda x: spec.fn(x, **cfg).sum(), x)
    plain = residuals(lambda x: spec.reference(x, **cfg).sum(), x)
    big = [r for r in ours.rows if r.nbytes >= x.size]
    # An input kept as a residual stays unnamed (it is the argument itself).
    kept_by_op = big and (big[0].op == name or big[0].source.startswith("from the argument"))
    assert len(big) == 1 and kept_by_op, str(ours)
    assert ours.total_bytes <= plain.total_bytes, f"ours:\n{ours}\nplain:\n{plain}"


@pytest.mark.parametrize("name,cfg", OPS)
def test_reuse_metadata_matches_what_is_saved(name, cfg):
    # An op that declares it may overwrite its input must not keep that input.
    spec = registry()[name]
    (x,) = spec.sample(jax.random.key(0))
    report = residuals(lambda x: spec.fn(x, **cfg).sum(), x)
    keeps_input = any(
        (r.op == name and r.source.startswith(f"named 'cannjax.{name}.x'"))
        or r.source.startswith("from the argument x")
        for r in report.rows
    )
    assert keeps_input == (0 not in spec.reuse)


def test_relu_saves_a_boolean_mask():
    report = residuals(lambda x: cannjax.ops.relu(x).sum(), jnp.ones((8, 8)))
    assert [r.dtype for r in report.rows] == ["bool"]


@pytest.mark.parametrize("op", ["softplus", "log_sigmoid", "sigmoid"])
def test_stable_at_extreme_inputs(op):
    x = jnp.array([-1e4, 1e4, -88.0, 88.0])
    fn, ref = registry()[op].fn, registry()[op].reference
    with jax.enable_x64(True):
        want = np.asarray(ref(x.astype(jnp.float64)))
    got = np.asarray(fn(x))
    # XLA:CPU flushes float32 denormals to zero, hence atol = smallest normal.
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=np.finfo(np.float32).tiny)
    g = jax.grad(lambda x: fn(x).sum())(x)
    assert np.isfinite(g).all()


def test_gelu_and_silu_are_finite_where_plain_autodiff_is_nan():
    x = jnp.array([1e20, -1e20, jnp.inf, -jnp.inf])
    assert np.isnan(jax.vmap(jax.grad(lambda v: jax.nn.gelu(v)))(x)).any()
    for f in (cannjax.ops.gelu, cannjax.ops.silu):
        g = jax.vmap(jax.grad(f))(x)
        np.testing.assert_array_equal(g, [1.0, 0.0, 1.0, 0.0])


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("name", sorted(n for n, _ in {(p.values[0], 0) for p in OPS}))
def test_non_real_input_is_a_type_error(name):
    # Integers and booleans promote as in jax.nn (tests/test_parity.py); complex numbers
    # and Python lists do not.
    fn = registry()[name].fn
    with pytest.raises(TypeError, match=rf"cannjax\.ops\.{name}: x must be a real"):
        fn(jnp.arange(3) * 1j)
    with pytest.raises(TypeError, match=rf"cannjax\.ops\.{name}: x must be a real"):
        jax.jit(fn)(jnp.array([1j, 2.0]))
    with pytest.raises(TypeError, match=rf"cannjax\.ops\.{name}: x must be an array or a Python"):
        fn([1.0])


def test_gelu_rejects_unknown_approximate():
    with pytest.raises(ValueError, match=r"cannjax\.ops\.gelu: approximate must be True"):
        cannjax.ops.gelu(jnp.ones(2), approximate="tanh")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_exact_gelu_keeps_its_left_tail(dtype):
    # 0.5 x (1 + erf(x / sqrt 2)) cancels below x ~ -2.6: gelu(-6) was -0.0 in float32 and
    # the float64 relative error reached 3.7e-2. Phi = erfc(-x / sqrt 2) / 2 keeps it.
    xs = np.concatenate([np.linspace(-12.0, -2.0, 81), np.linspace(-1.9, 4.1, 25)])
    exact = lambda x: jax.nn.gelu(x, approximate=False)  # noqa: E731
    ours = lambda x: ops.gelu(x, approximate=False)  # noqa: E731
    # Relative error, with a floor of 0.1 next to the zeros of gelu (0) and its slope (-0.752).
    floor = np.where((np.abs(xs) < 0.5) | (np.abs(xs + 0.752) < 0.5), 0.1, 0.0)
    with jax.enable_x64(True):
        x64 = jnp.asarray(xs.astype(dtype), jnp.float64)  # the inputs, exactly
        want, dwant = np.asarray(exact(x64)), np.asarray(jax.vmap(jax.grad(exact))(x64))
        x = jnp.asarray(xs, dtype)
        for f, ref in ((lambda f: f, want), (lambda f: jax.vmap(jax.grad(f)), dwant)):
            scale = np.maximum(np.abs(ref), floor)
            err_ours = np.abs(np.asarray(f(ours)(x), np.float64) - ref) / scale
            if dtype == "float32":  # as accurate as jax.nn to a few ulps
                err_jax = np.abs(np.asarray(f(exact)(x), np.float64) - ref) / scale
                assert np.all(err_ours <= err_jax + 4 * float(jnp.finfo(dtype).eps))
            # float64: the reference is jax.nn's float64 (erfc), which agrees with ours to
            # the conditioning of erfc (about 2 x^2 ulps at x); the old form was 3.7e-2 off.
            assert np.max(err_ours) < (1e-5 if dtype == "float32" else 1e-12)
