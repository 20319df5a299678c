"""layer_norm and rms_norm: check_op, transforms, residuals, half precision, bad input;
and the memory of the 16-block linear + gelu + layer_norm stack (benchmarks/nn_ops.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
from benchmarks.nn_ops import stack_args, stack_loss, stack_memory
from cannjax.core import registry
from cannjax.inspect import residuals
from tests._nn_transforms import TRANSFORMS, run_transform
from tests._ops import check_edge_points, check_half_forward, check_random_points, op_configs

OPS = op_configs("normalization")
NAMES = ["layer_norm", "rms_norm"]


def test_family_is_registered():
    assert sorted({p.values[0] for p in OPS}) == NAMES


@pytest.mark.parametrize("name,cfg", OPS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_check_op_random_points(name, cfg, dtype):
    check_random_points(name, cfg, dtype, seeds=(1,))


@pytest.mark.parametrize("name,cfg", OPS)
# float32 edge points: `cannjax ops` runs check_op at each of them, under every config,
# for every operator (tests/test_cli.py::test_ops_self_check_passes_for_every_operator).
@pytest.mark.parametrize("dtype", ["float64"])
def test_check_op_edge_points(name, cfg, dtype):
    check_edge_points(name, cfg, dtype)


@pytest.mark.parametrize("name,cfg", OPS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_forward(name, cfg, dtype):
    check_half_forward(name, cfg, dtype)


@pytest.mark.parametrize("name", NAMES)
def test_half_precision_statistics_accumulate_in_float32(name):
    fn, ref = registry()[name].fn, registry()[name].reference
    # A large offset with a small spread: bfloat16 statistics would lose the spread.
    x = (1000 + 8 * jax.random.normal(jax.random.key(0), (4, 256))).astype(jnp.bfloat16)
    params = (jnp.ones(256), jnp.zeros(256))[: 2 if name == "layer_norm" else 1]
    half = tuple(p.astype(jnp.bfloat16) for p in params)
    want = ref(x.astype(jnp.float32), *params)
    got = fn(x, *half)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-2, atol=1e-2)
    report = residuals(lambda x: fn(x, *half).astype(jnp.float32).sum(), x)
    stats = [r for r in report.rows if r.shape == (4,)]
    assert stats and all(r.dtype == "float32" for r in stats), str(report)
    g = jax.grad(lambda x: jnp.sum(fn(x, *half).astype(jnp.float32) ** 2))(x)
    g_ref = jax.grad(lambda x: jnp.sum(ref(x, *params) ** 2))(x.astype(jnp.float32))
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g_ref), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("name", NAMES)
def test_composes_with_transforms(name, transform):
    run_transform(name, transform, registry()[name].sample(jax.random.key(2)))


@pytest.mark.parametrize("name", NAMES)
def test_constant_and_zero_rows_are_finite(name):
    spec = registry()[name]
    _, *params = spec.sample(jax.random.key(0))
    x = jnp.stack([jnp.zeros(8), jnp.full(8, -3.0), jnp.full(8, 1e-20)])
    y, (gx, *gp) = jax.value_and_grad(lambda *a: jnp.sum(spec.fn(*a) ** 3), (0, 1))(x, *params)
    assert np.isfinite(y) and np.isfinite(gx).all() and np.isfinite(gp).all()
    h = jax.hessian(lambda x: jnp.sum(spec.fn(x, *params) ** 3))(x)
    assert np.isfinite(h).all()


def test_layer_norm_of_a_constant_row_is_the_bias_with_exact_gradient():
    scale, bias = jnp.array([2.0, -1.0, 0.5]), jnp.array([0.1, 0.2, 0.3])
    x = jnp.full((1, 3), 7.0)
    np.testing.assert_allclose(cannjax.ops.layer_norm(x, scale, bias), bias[None], atol=1e-6)
    # dx = rstd (g scale - mean(g scale)) with rstd = eps^-1/2 and xhat = 0.
    g = jnp.array([[1.0, 0.0, 0.0]])
    _, vjp = jax.vjp(lambda x: cannjax.ops.layer_norm(x, scale, bias, eps=1e-2), x)
    gs = g * scale[None]
    np.testing.assert_allclose(vjp(g)[0], 10.0 * (gs - gs.mean()), rtol=1e-5)


# ---------------------------------------------------------------- residuals
@pytest.mark.parametrize("name", NAMES)
def test_residual_bytes_never_more_than_plain_jax(name):
    spec = registry()[name]
    x, *params = spec.sample(jax.random.key(0))
    x = jnp.tile(x, (8, 4))[:, : x.shape[1]]  # [24, 8]
    ours = residuals(lambda *a: jnp.sum(jnp.sin(spec.fn(*a))), x, *params)
    plain = residuals(lambda *a: jnp.sum(jnp.sin(spec.reference(*a))), x, *params)
    assert ours.total_bytes < plain.total_bytes, f"ours:\n{ours}\nplain:\n{plain}"


@pytest.mark.parametrize("name", NAMES)
def test_keeps_its_input_and_row_statistics_only(name):
    spec = registry()[name]
    x, *params = spec.sample(jax.random.key(0))
    c = jax.random.normal(jax.random.key(1), x.shape)
    report = residuals(lambda *a: jnp.sum(spec.fn(*a) * c), x, *params)
    # x (the argument itself: an input residual keeps its identity), scale, statistics.
    stats = ["mean", "rstd"] if name == "layer_norm" else ["rstd"]
    named = sorted(
        re.search(rf"cannjax\.{name}\.(\w+)", r.source).group(1)
        for r in report.rows
        if r.op == name
    )
    assert named == stats, str(report)
    kept = [r for r in report.rows if r.source != "from a constant"]  # c, the loss weights
    assert sorted(r.shape for r in kept) == sorted(
        [x.shape, params[0].shape] + [x.shape[:-1]] * len(stats)
    ), str(report)


# ---------------------------------------------------------------- the block stack
@pytest.mark.parametrize("form,bound", [("scan", 0.5), ("loop", 0.65)])
def test_block_stack_gradient_memory_against_plain_jax(form, bound):
    # Same claim as benchmarks/nn_ops.py (16 x [256, 1024]: 0.36x scan, 0.60x loop), at
    # a size that compiles in seconds.
    mem = stack_memory(4, 64, 128, form)
    assert mem["cannjax"] <= bound * mem["plain"], mem


def test_scan_stack_keeps_three_activations_per_layer():
    layers, batch, width = 3, 16, 32
    args = stack_args(layers, batch, width, "scan")
    full = (layers, batch, width)
    ours = residuals(stack_loss("cannjax", "scan"), *args)
    plain = residuals(stack_loss("plain", "scan"), *args)
    n_ours = sum(r.shape == full for r in ours.rows)
    n_plain = sum(r.shape == full for r in plain.rows)
    # Block input (linear's x), linear output (gelu's x), gelu output (layer_norm's x).
    assert n_ours == 3 and n_plain > 3, f"ours:\n{ours}\nplain:\n{plain}"
    # Stacked weights are forwarded from the argument, never copied.
    assert not [r for r in ours.rows if r.shape == args[1].shape and "argument" not in r.source]


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("name", NAMES)
def test_rejects_wrong_parameter_shapes(name):
    fn = registry()[name].fn
    extra = (jnp.zeros(4),) if name == "layer_norm" else ()
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"cannjax.ops.{name}: scale must have shape x.shape[-1:] == (4,) (one value per "
            "feature), got (3,)"
        ),
    ):
        fn(jnp.ones((2, 4)), jnp.ones(3), *extra)
    with pytest.raises(ValueError, match=rf"cannjax\.ops\.{name}: x must have rank >= 1"):
        fn(jnp.float32(1.0), jnp.ones(()), *(jnp.ones(()) for _ in extra))
    with pytest.raises(ValueError, match=rf"cannjax\.ops\.{name}: eps must be a positive number"):
        fn(jnp.ones((2, 4)), jnp.ones(4), *extra, eps=0.0)


def test_layer_norm_rejects_wrong_bias_shape():
    with pytest.raises(
        ValueError, match=r"cannjax\.ops\.layer_norm: bias must have shape .*\(4,\).*got \(4, 1\)"
    ):
        cannjax.ops.layer_norm(jnp.ones((2, 4)), jnp.ones(4), jnp.ones((4, 1)))


@pytest.mark.parametrize("name", NAMES)
def test_rejects_non_float_input(name):
    fn = registry()[name].fn
    extra = (jnp.zeros(4),) if name == "layer_norm" else ()
    with pytest.raises(TypeError, match=rf"cannjax\.ops\.{name}: x must be a floating-point"):
        fn(jnp.ones((2, 4), jnp.int32), jnp.ones(4), *extra)
    with pytest.raises(TypeError, match=rf"cannjax\.ops\.{name}: scale must be a floating-point"):
        jax.jit(fn)(jnp.ones((2, 4)), jnp.ones(4, bool), *extra)
