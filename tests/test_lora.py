"""lora_linear: check_op, flax.nnx.LoRALinear equality, the frozen w (zero gradient at
every order, no weight-gradient product), residuals, the w-differentiable variant that
cannjax.optimize substitutes, half precision and bad input."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import cannjax
from cannjax._src.ops.lora import _sample, lora_linear_with_w_grad
from cannjax.core import OpSpec, registry
from cannjax.inspect import residuals
from cannjax.testing import check_op
from tests import _rng as rand
from tests._ops import cast, check_edge_points, check_half_forward, check_random_points

SPEC = registry()["lora_linear"]
CONFIGS = [pytest.param(dict(c), id=f"scale={c['scale']}") for c in SPEC.configs]
EXTENDED = pytest.mark.extended
lora_linear = cannjax.ops.lora_linear


def _plain(x, w, a, b, bias=None, *, scale=1.0):
    """LoRA as users write it."""
    y = x @ w + (x @ a) @ b * scale
    return y if bias is None else y + bias.reshape((1,) * (y.ndim - 1) + bias.shape)


def _args(shape=(3, 5, 16), out=12, r=4, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    d = shape[-1]
    return (
        rand.normal(k[0], shape),
        rand.normal(k[1], (d, out)) / 4,
        rand.normal(k[2], (d, r)) / 4,
        rand.normal(k[3], (r, out)) / 2,
        rand.normal(k[4], (out,)),
    )


def test_registered_with_w_not_differentiated():
    assert SPEC.fn is lora_linear
    assert SPEC.nondiff_argnums == (1,)
    assert set(SPEC.residuals) == {"x", "w", "a", "b", "xa"}


# ---------------------------------------------------------------- check_op
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dtype", ["float64", pytest.param("float32", marks=EXTENDED)])
def test_check_op_random_points(cfg, dtype):
    check_random_points("lora_linear", cfg, dtype, seeds=(1,))


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dtype", ["float64", pytest.param("float32", marks=EXTENDED)])
def test_check_op_edge_points(cfg, dtype):
    check_edge_points("lora_linear", cfg, dtype)


def test_bfloat16_values():
    check_half_forward("lora_linear", {"scale": 2.0}, "bfloat16")


# ---------------------------------------------------------------- flax.nnx.LoRALinear
@pytest.mark.parametrize("use_bias", [True, False])
def test_equals_flax_lora_linear(use_bias):
    # flax.nnx.LoRALinear is kernel + bias + (x @ lora_a) @ lora_b: scale 1.
    layer = nnx.LoRALinear(16, 12, lora_rank=4, use_bias=use_bias, rngs=nnx.Rngs(0))
    layer.lora.lora_b[...] = rand.normal(jax.random.key(1), (4, 12)) / 2  # it starts at 0
    if use_bias:
        layer.bias[...] = rand.normal(jax.random.key(2), (12,))
    x = rand.normal(jax.random.key(3), (3, 5, 16))
    c = rand.normal(jax.random.key(4), (3, 5, 12))
    w, a, b = layer.kernel[...], layer.lora.lora_a[...], layer.lora.lora_b[...]
    bias = (layer.bias[...],) if use_bias else ()
    np.testing.assert_allclose(lora_linear(x, w, a, b, *bias), layer(x), rtol=2e-5, atol=2e-5)

    # The adapters' gradients, as flax users take them (nnx.DiffState on LoRAParam), and x's.
    def flax_loss(layer, x):
        return jnp.sum(layer(x) * c)

    flax_grads, flax_dx = nnx.grad(flax_loss, argnums=(nnx.DiffState(0, nnx.LoRAParam), 1))(
        layer, x
    )
    ours = jax.grad(lambda x, a, b: jnp.sum(lora_linear(x, w, a, b, *bias) * c), (0, 1, 2))
    dx, da, db = ours(x, a, b)
    np.testing.assert_allclose(dx, flax_dx, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(da, flax_grads["lora"]["lora_a"][...], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(db, flax_grads["lora"]["lora_b"][...], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_values_and_gradients_equal_plain_autodiff(scale):
    x, w, a, b, bias = _args()
    c = rand.normal(jax.random.key(9), (3, 5, 12))
    ours = lambda *p: jnp.sum(lora_linear(*p, scale=scale) * c)  # noqa: E731
    plain = lambda *p: jnp.sum(_plain(*p, scale=scale) * c)  # noqa: E731
    np.testing.assert_allclose(ours(x, w, a, b, bias), plain(x, w, a, b, bias), rtol=1e-5)
    nums = (0, 2, 3, 4)
    for g, p in zip(
        jax.grad(ours, nums)(x, w, a, b, bias), jax.grad(plain, nums)(x, w, a, b, bias)
    ):
        np.testing.assert_allclose(g, p, rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------- the frozen w
def test_w_gets_zero_gradient_and_nothing_is_computed_for_it():
    x, w, a, b, bias = _args()
    f = lambda w: jnp.sum(jnp.sin(lora_linear(x, w, a, b, bias, scale=2.0)))  # noqa: E731
    assert float(jnp.abs(jax.grad(f)(w)).max()) == 0.0
    # No tangent reaches the operator: its tangent map (cannjax_lin) is never bound.
    assert "cannjax_lin" not in str(jax.make_jaxpr(jax.grad(f))(w))
    # Forward mode and vmap agree.
    _, t = jax.jvp(f, (w,), (jnp.ones_like(w),))
    assert float(t) == 0.0
    assert float(jnp.abs(jax.vmap(jax.grad(f))(jnp.stack([w, 2 * w]))).max()) == 0.0

    # Every order: the gradient of x's gradient with respect to w is zero too, as for the
    # reference x @ stop_gradient(w) + ...
    def grad_x_norm(op):
        return lambda w: jnp.sum(jax.grad(lambda x: jnp.sum(jnp.sin(op(x, w, a, b))))(x) ** 2)

    gx, ref = grad_x_norm(lora_linear), grad_x_norm(SPEC.reference)
    assert float(jnp.abs(jax.grad(ref)(w)).max()) == 0.0
    assert float(jnp.abs(jax.grad(gx)(w)).max()) == 0.0


_DOT = re.compile(r"= (\w+)\[([\d,]*)\]\{[^}]*\} dot\(")


def _dot_shapes(f, *args):
    text = jax.jit(f).lower(*args).compile().as_text()
    return [m.group(2) for m in map(_DOT.search, text.splitlines()) if m]


@pytest.mark.parametrize("op", [lora_linear, lora_linear_with_w_grad], ids=["frozen", "w_grad"])
def test_backward_has_no_weight_sized_product(op):
    # D = 96, E = 40, r = 4, N = 64 rows: no dot in the compiled gradient has a [96, 40]
    # result, w an argument of the jitted function (not closed over) and not
    # differentiated. For the w_grad variant its dw = x^T g is dead code there.
    x, w, a, b = jnp.ones((4, 16, 96)), jnp.ones((96, 40)), jnp.ones((96, 4)), jnp.ones((4, 40))
    grad = jax.grad(lambda x, w, a, b: jnp.sum(op(x, w, a, b, scale=0.5) ** 2), argnums=(0, 2, 3))
    shapes = _dot_shapes(grad, x, w, a, b)
    # 3 forward (x w, x a, xa b), 5 backward (g b^T, g w^T, dxa a^T, x^T dxa, xa^T g)
    assert sorted(shapes) == sorted(
        ["64,40", "64,4", "64,40", "64,4", "64,96", "64,96", "96,4", "4,40"]
    ), shapes
    # The check can fail: plain autodiff with w differentiated builds it.
    plain = jax.grad(lambda x, w, a, b: jnp.sum(_plain(x, w, a, b) ** 2), argnums=(0, 1, 2, 3))
    assert "96,40" in _dot_shapes(plain, x, w, a, b)
    if op is lora_linear:  # even asked for w's gradient, the frozen op computes none
        asked = jax.grad(lambda *p: jnp.sum(op(*p) ** 2), argnums=(0, 1, 2, 3))
        assert "96,40" not in _dot_shapes(asked, x, w, a, b)


def test_residuals_are_x_and_the_rank_r_projection():
    x, w, a, b, bias = _args(shape=(4, 32, 16))
    c = rand.normal(jax.random.key(6), (4, 32, 12))
    f = lambda x, a, b: jnp.sum(lora_linear(x, w, a, b, bias, scale=0.5) * c)  # noqa: E731
    rows = residuals(f, x, a, b).rows
    activations = sorted(
        (r.shape, r.op) for r in rows if r.shape[:2] == (4, 32) and r.shape != c.shape
    )
    assert activations == [((4, 32, 4), "lora_linear"), ((4, 32, 16), None)], rows
    (xa,) = [r for r in rows if r.op == "lora_linear"]
    assert "cannjax.lora_linear.xa" in xa.source and xa.nbytes == 4 * 32 * 4 * 4
    # Nothing of w's size but w itself (an input, not a copy), and no [..., E] array but
    # the constant c.
    assert [r.shape for r in rows if r.shape == (16, 12)] == [(16, 12)]
    assert [r.source for r in rows if r.shape == c.shape] == ["from a constant"]
    plain = lambda x, a, b: jnp.sum(_plain(x, w, a, b, bias, scale=0.5) * c)  # noqa: E731
    assert residuals(f, x, a, b).total_bytes <= residuals(plain, x, a, b).total_bytes


def test_w_closed_over_or_not_keeps_no_zeros():
    # A weight that is not differentiated has a symbolic zero tangent, which is neither
    # materialized nor saved for the backward (no [16, 12] zeros among the residuals).
    x, w, a, b, _ = _args(shape=(4, 32, 16))
    f = lambda x, w, a, b: jnp.sum(jnp.sin(lora_linear_with_w_grad(x, w, a, b)))  # noqa: E731
    rows = residuals(lambda a, b: f(x, w, a, b), a, b).rows
    assert not [r for r in rows if "broadcast" in r.source], rows


# ---------------------------------------------------------------- the w_grad variant
def _with_w_reference(x, w, a, b, bias=None, *, scale=1.0):
    return _plain(x, w, a, b, bias, scale=scale)


W_GRAD = OpSpec(
    name="lora_linear",
    fn=lora_linear_with_w_grad,
    reference=_with_w_reference,
    sample=_sample,
    residuals=SPEC.residuals,
    configs=SPEC.configs,
    edges=SPEC.edges,
)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_w_grad_variant_check_op(cfg):
    with jax.enable_x64(True):
        check_op(W_GRAD, *cast(_sample(jax.random.key(2)), "float64"), **cfg)


@EXTENDED
def test_w_grad_variant_check_op_edges():
    for case in SPEC.edges():
        if case.expected_grad is not None:  # written for lora_linear's arguments
            continue
        with jax.enable_x64(True):
            check_op(W_GRAD, *cast(case.args, "float64"), **case.check_kwargs({"scale": 2.0}))


def test_w_grad_variant_gives_w_its_gradient():
    x, w, a, b, bias = _args()
    f = lambda *p: jnp.sum(jnp.tanh(lora_linear_with_w_grad(*p, scale=0.5)))  # noqa: E731
    g = lambda *p: jnp.sum(jnp.tanh(_plain(*p, scale=0.5)))  # noqa: E731
    for got, want in zip(jax.grad(f, (0, 1, 2, 3, 4))(x, w, a, b, bias),
                         jax.grad(g, (0, 1, 2, 3, 4))(x, w, a, b, bias)):  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------- half precision
def test_bfloat16_gradients_are_close_to_float32():
    args = _args(seed=4)
    c = rand.normal(jax.random.key(5), (3, 5, 12))

    def grads(dtype):
        p = cast(args, dtype)
        f = lambda x, a, b, bias: jnp.sum(lora_linear(x, p[1], a, b, bias).astype(jnp.float32) * c)  # noqa: E731
        return jax.grad(f, argnums=(0, 1, 2, 3))(p[0], p[2], p[3], p[4])

    for g, w in zip(grads("bfloat16"), grads("float32"), strict=True):
        assert g.dtype == jnp.bfloat16
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=0, atol=3e-2 * scale)


def test_mixed_dtypes_promote():
    x, w, a, b = (
        jnp.ones((2, 4), jnp.bfloat16),
        jnp.ones((4, 3)),
        jnp.ones((4, 2)),
        jnp.ones((2, 3)),
    )
    assert lora_linear(x, w, a, b).dtype == jnp.float32
    half = [v.astype(jnp.bfloat16) for v in (w, a, b)]
    assert lora_linear(x, *half).dtype == jnp.bfloat16


# ---------------------------------------------------------------- bad input
def _raises(exc, message, *args, **kwargs):
    with pytest.raises(exc, match=re.escape(message)):
        lora_linear(*args, **kwargs)


def test_rejects_wrong_shapes():
    x, w, a, b = jnp.ones((2, 8)), jnp.ones((8, 6)), jnp.ones((8, 2)), jnp.ones((2, 6))
    lora_linear(x, w, a, b, jnp.ones(6), scale=2.0)  # the valid call
    fn = "cannjax.ops.lora_linear"
    _raises(ValueError, f"{fn}: b must have shape (r, E) == (2, 6), the rank r of a "
            "(a.shape = (8, 2)) and the output width E of w (w.shape = (8, 6)), got (3, 6)",
            x, w, a, jnp.ones((3, 6)))  # fmt: skip
    _raises(ValueError, f"{fn}: b must have shape (r, E) == (2, 6)", x, w, a, jnp.ones((2, 5)))
    _raises(ValueError, f"{fn}: b must have shape (r, E) == (2, 6)", x, w, a, jnp.ones(6))
    _raises(ValueError, f"{fn}: a must have shape (D, r) with D == x.shape[-1] == 8, got (6, 2)",
            x, w, jnp.ones((6, 2)), b)  # fmt: skip
    _raises(ValueError, f"{fn}: a must have shape (D, r)", x, w, jnp.ones(8), b)
    _raises(ValueError, f"{fn}: w must have shape (D, E) with D == x.shape[-1] == 8, got (4, 6)",
            x, jnp.ones((4, 6)), a, b)  # fmt: skip
    _raises(ValueError, f"{fn}: bias must have shape (E,) == (6,) to match w.shape = (8, 6), "
            "got (2, 6)", x, w, a, b, jnp.ones((2, 6)))  # fmt: skip
    _raises(ValueError, f"{fn}: x must have rank >= 1", jnp.float32(1.0), w, a, b)


def test_rejects_non_float_input_and_bad_scales():
    x, w, a, b = jnp.ones((2, 8)), jnp.ones((8, 6)), jnp.ones((8, 2)), jnp.ones((2, 6))
    fn = "cannjax.ops.lora_linear"
    _raises(TypeError, f"{fn}: x must be a floating-point", jnp.ones((2, 8), jnp.int32), w, a, b)
    _raises(TypeError, f"{fn}: a must be a floating-point", x, w, jnp.ones((8, 2), bool), b)
    _raises(TypeError, f"{fn}: bias must be a floating-point", x, w, a, b, jnp.ones(6, jnp.int8))
    _raises(TypeError, f"{fn}: scale must be a real number, got True", x, w, a, b, scale=True)
    _raises(TypeError, f"{fn}: scale must be a real number, got str", x, w, a, b, scale="2")
    _raises(ValueError, f"{fn}: scale must be finite, got nan", x, w, a, b, scale=float("nan"))
    with pytest.raises(TypeError, match=re.escape(f"{fn}: scale must be a Python number")):
        jax.jit(lambda s: lora_linear(x, w, a, b, scale=s))(2.0)
    # A concrete 0-d array is a number.
    np.testing.assert_allclose(lora_linear(x, w, a, b, scale=jnp.float32(0.5)),
                               lora_linear(x, w, a, b, scale=0.5))  # fmt: skip
