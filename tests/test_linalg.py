"""linear and matmul: check_op, transforms, residuals, fast backward dots, bad input."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
from cannjax.core import registry
from cannjax.inspect import residuals
from tests import _rng as rand
from tests._nn_transforms import TRANSFORM_PARAMS, run_transform
from tests._ops import (
    CHECK_DTYPES,
    check_edge_points,
    check_half_forward,
    check_random_points,
    op_configs,
)

OPS = op_configs("linalg")
NAMES = ["linear", "matmul"]


def test_family_is_registered():
    assert sorted({p.values[0] for p in OPS}) == NAMES


@pytest.mark.parametrize("name,cfg", OPS)
@pytest.mark.parametrize("dtype", CHECK_DTYPES)
def test_check_op_random_points(name, cfg, dtype):
    check_random_points(name, cfg, dtype, seeds=(1,))


@pytest.mark.parametrize("name,cfg", OPS)
# float32 edge points: `cannjax ops` runs check_op at each of them, under every config,
# for every operator (tests/test_cli.py::test_ops_self_check_passes_for_every_operator).
# These float64 sweeps are long: `make test-extended` (CI) runs them.
@pytest.mark.parametrize("dtype", [pytest.param("float64", marks=pytest.mark.extended)])
def test_check_op_edge_points(name, cfg, dtype):
    check_edge_points(name, cfg, dtype)


@pytest.mark.parametrize("name,cfg", OPS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_forward(name, cfg, dtype):
    check_half_forward(name, cfg, dtype)


@pytest.mark.parametrize("transform", TRANSFORM_PARAMS)
@pytest.mark.parametrize("name", NAMES)
def test_composes_with_transforms(name, transform):
    run_transform(name, transform, registry()[name].sample(jax.random.key(2)))


def test_linear_without_bias_composes_with_hessian_and_vmap():
    x, w, _ = registry()["linear"].sample(jax.random.key(3))
    run_transform("linear", "hessian", (x, w))
    run_transform("linear", "vmap", (x, w))


# ---------------------------------------------------------------- residuals
@pytest.mark.parametrize("name", NAMES)
def test_residual_bytes_never_more_than_plain_jax(name):
    spec = registry()[name]
    args = spec.sample(jax.random.key(0))
    c = rand.normal(jax.random.key(1), spec.fn(*args).shape)
    ours = residuals(lambda *a: jnp.sum(spec.fn(*a) * c), *args)
    plain = residuals(lambda *a: jnp.sum(spec.reference(*a) * c), *args)
    assert ours.total_bytes <= plain.total_bytes, f"ours:\n{ours}\nplain:\n{plain}"


def test_linear_keeps_x_and_w_only():
    x, w, b = registry()["linear"].sample(jax.random.key(0))
    report = residuals(lambda *a: cannjax.ops.linear(*a).sum(), x, w, b)
    assert sorted(r.shape for r in report.rows) == sorted([x.shape, w.shape])
    assert report.total_bytes == x.nbytes + w.nbytes


def test_scan_forwards_stacked_weights_instead_of_copying_them():
    # The weight residual is the scanned-over slice itself: lax.scan must forward it
    # from its input, not stack a copy of every layer's weight.
    ws = rand.normal(jax.random.key(0), (3, 8, 8)) / 3

    def loss(x, ws):
        return jax.lax.scan(lambda c, w: (jnp.tanh(cannjax.ops.linear(c, w)), None), x, ws)[0].sum()

    report = residuals(loss, jnp.ones((4, 8)), ws)
    weight_like = [r for r in report.rows if r.shape == ws.shape]
    assert [r.source for r in weight_like] == ["from the argument ws"], str(report)


# ---------------------------------------------------------------- fast backward dots
_DOT = re.compile(r" dot\((.*)")


def _dots(f, *args):
    text = jax.jit(f).lower(*args).compile().as_text()
    return [m.group(1) for m in map(_DOT.search, text.splitlines()) if m]


_ROWS = "lhs_contracting_dims={0}, rhs_contracting_dims={0}"


def test_linear_backward_folds_rows_and_copies_no_transpose():
    # Every batch axis folds into rows: dx = g2 w^T contracts the left operand's last
    # axis, dw = x2^T g2 is one dot contracting the rows of both (the form that keeps
    # one layout of g for the partitioner, tests/test_sharding.py), with no transposed
    # copy of x [in=96, N=64] or g [out=8, N].
    x, w, b = jnp.ones((4, 16, 96)), jnp.ones((96, 8)), jnp.ones(8)
    grad = jax.grad(lambda *a: jnp.sum(cannjax.ops.linear(*a) ** 2), argnums=(0, 1, 2))
    dots = _dots(grad, x, w, b)
    assert len(dots) == 3, dots
    assert sum(_ROWS in d for d in dots) == 1, dots
    assert sum("lhs_contracting_dims={1}" in d for d in dots) == 2, dots
    text = jax.jit(grad).lower(x, w, b).compile().as_text()
    assert "f32[96,64]" not in text and "f32[8,64]" not in text
    # The check can fail: plain autodiff of the rank-3 x @ w copies g transposed.
    plain = jax.grad(lambda x, w: jnp.sum((x @ w) ** 2), argnums=(0, 1))
    assert "f32[8,64]" in jax.jit(plain).lower(x, w).compile().as_text()
    np.testing.assert_allclose(
        grad(x, w, b)[1], jax.grad(lambda w: jnp.sum((x @ w + b[None, None]) ** 2))(w), rtol=1e-6
    )


@pytest.mark.parametrize(
    "shape_a,shape_b,copies_a_t",
    [
        # Large matrices (>= 2^23 multiply-adds each): a^T is copied for the fast path.
        ((2, 256, 256), (2, 256, 256), True),
        ((2, 1, 256, 256), (3, 256, 256), True),
        # Small ones: a^T g is left as emitted; XLA's generic batched dot beats copying
        # a^T for YNNPACK (benchmarks/xla_cpu_facts.py).
        ((4, 16, 32), (4, 32, 8), False),
        ((2, 1, 16, 32), (3, 32, 8), False),
    ],
)
def test_batched_matmul_backward_dot_forms(shape_a, shape_b, copies_a_t):
    a = rand.normal(jax.random.key(0), shape_a)
    b = rand.normal(jax.random.key(1), shape_b)
    grad = jax.grad(lambda a, b: jnp.sum(cannjax.ops.matmul(a, b) ** 2), argnums=(0, 1))
    dots = _dots(grad, a, b)
    nbatch = len(jnp.broadcast_shapes(shape_a[:-2], shape_b[:-2]))
    last, first = (f"lhs_contracting_dims={{{d}}}" for d in (nbatch + 1, nbatch))
    assert len(dots) == 3, dots
    if copies_a_t:
        assert all(last in d for d in dots), dots
        plain = jax.grad(lambda a, b: jnp.sum(jnp.matmul(a, b) ** 2), argnums=(0, 1))
        assert not all(last in d for d in _dots(plain, a, b))
    else:
        assert sum(first in d for d in dots) == 1, dots
    want = jax.grad(lambda a, b: jnp.sum(jnp.matmul(a, b) ** 2), argnums=(0, 1))(a, b)
    for got, ref in zip(grad(a, b), want):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))


def test_matmul_with_matrix_on_the_right_folds_batch_axes_into_rows():
    a, b = jnp.ones((4, 16, 32)), jnp.ones((32, 8))
    grad = jax.grad(lambda a, b: jnp.sum(cannjax.ops.matmul(a, b) ** 2), argnums=(0, 1))
    dots = _dots(grad, a, b)
    assert len(dots) == 3 and all("batch_dims" not in d for d in dots), dots
    assert sum(_ROWS in d for d in dots) == 1, dots


def test_mixed_dtypes_promote_like_jnp():
    x = jnp.ones((2, 3), jnp.bfloat16)
    w = jnp.ones((3, 4), jnp.float32)
    assert cannjax.ops.linear(x, w).dtype == (x @ w).dtype
    assert cannjax.ops.matmul(x, w).dtype == jnp.matmul(x, w).dtype
    g = jax.grad(lambda x: cannjax.ops.linear(x, w).astype(jnp.float32).sum())(x)
    assert g.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.full((2, 3), 4.0))


# ---------------------------------------------------------------- bad input
def test_linear_rejects_mismatched_weight():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "cannjax.ops.linear: w must have shape (in, out) with in == x.shape[-1] == 256, "
            "got (512, 128)"
        ),
    ):
        cannjax.ops.linear(jnp.ones((2, 256)), jnp.ones((512, 128)))
    with pytest.raises(ValueError, match=r"cannjax\.ops\.linear: w must have shape \(in, out\)"):
        jax.jit(cannjax.ops.linear)(jnp.ones((2, 4)), jnp.ones(4))


def test_linear_rejects_mismatched_bias():
    with pytest.raises(
        ValueError, match=r"cannjax\.ops\.linear: b must have shape \(out,\) == \(3,\).*got \(4,\)"
    ):
        cannjax.ops.linear(jnp.ones((2, 4)), jnp.ones((4, 3)), jnp.ones(4))
    with pytest.raises(ValueError, match=r"cannjax\.ops\.linear: b must have shape.*got \(1, 3\)"):
        cannjax.ops.linear(jnp.ones((2, 4)), jnp.ones((4, 3)), jnp.ones((1, 3)))


def test_linear_rejects_scalar_and_non_float_input():
    with pytest.raises(ValueError, match=r"cannjax\.ops\.linear: x must have rank >= 1"):
        cannjax.ops.linear(jnp.float32(1.0), jnp.ones((1, 3)))
    for args, arg in [
        ((jnp.arange(4).reshape(1, 4), jnp.ones((4, 3))), "x"),
        ((jnp.ones((1, 4)), jnp.ones((4, 3), jnp.int32)), "w"),
        ((jnp.ones((1, 4)), jnp.ones((4, 3)), jnp.array([True, False, True])), "b"),
    ]:
        with pytest.raises(
            TypeError, match=rf"cannjax\.ops\.linear: {arg} must be a floating-point array"
        ):
            cannjax.ops.linear(*args)


def test_matmul_rejects_mismatched_shapes():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "cannjax.ops.matmul: contracted sizes differ: a.shape[-1] == 3 but b.shape[-2] == 4"
        ),
    ):
        cannjax.ops.matmul(jnp.ones((2, 3)), jnp.ones((4, 5)))
    with pytest.raises(ValueError, match=r"b\.shape\[0\] == 4"):
        cannjax.ops.matmul(jnp.ones((2, 3)), jnp.ones(4))
    with pytest.raises(ValueError, match=r"cannjax\.ops\.matmul: batch shapes \(2,\).*\(3,\)"):
        cannjax.ops.matmul(jnp.ones((2, 2, 3)), jnp.ones((3, 3, 5)))
    with pytest.raises(ValueError, match=r"cannjax\.ops\.matmul: b must have rank >= 1"):
        cannjax.ops.matmul(jnp.ones(3), jnp.float32(2.0))
    with pytest.raises(TypeError, match=r"cannjax\.ops\.matmul: a must be a floating-point"):
        cannjax.ops.matmul(jnp.ones((2, 3), jnp.int32), jnp.ones((3, 4)))
