"""optimize's LoRA finder (cannjax/_src/optimization/finders/lora.py): flax.nnx ``LoRALinear``
layers and hand-written ``x @ w + (x @ a) @ b * s`` become one lora_linear each, with the
adapters' gradients of the original, fewer residuals and less compiled temp; ``w`` keeps
its true gradient unless it is provably constant; sums that are not LoRA are left to the
other finders."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import cannjax
from tests import _rng as rand

D, E, R = 32, 48, 4
_k = jax.random.split(jax.random.key(7), 6)
X = rand.normal(_k[0], (2, 16, D))
W = rand.normal(_k[1], (D, E)) / 6
A = rand.normal(_k[2], (D, R)) / 6
B = rand.normal(_k[3], (R, E)) / 2
BIAS = rand.normal(_k[4], (E,))
C = rand.normal(_k[5], (2, 16, E))
RTOL, ATOL = 2e-5, 1e-6


def _lora_rows(report):
    return [r for r in report.replaced if r.kind == "lora"]


# ------------------------------------------------------------------ flax.nnx
class LoRAMLP(nnx.Module):
    """Two LoRALinear layers, as flax users write a LoRA model."""

    def __init__(self, *, rngs):
        self.up = nnx.LoRALinear(D, E, lora_rank=R, rngs=rngs)
        self.down = nnx.LoRALinear(E, D, lora_rank=R, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def _model():
    model = LoRAMLP(rngs=nnx.Rngs(0))
    for i, layer in enumerate((model.up, model.down)):  # lora_b starts at 0: give it values
        b = layer.lora.lora_b
        b[...] = rand.normal(jax.random.key(10 + i), b.shape) / 4
    return model


def flax_loss(model, x):
    return jnp.mean(model(x) ** 2)


def test_flax_lora_linear_layers_are_found():
    report = cannjax.inspect.optimize(flax_loss, _model(), X)
    rows = _lora_rows(report)
    assert [r.op for r in rows] == ["lora_linear", "lora_linear"], str(report)
    # The model's state is an input: w may be differentiated, so its gradient is kept.
    assert rows[0].source.startswith("x @ w + (x @ a) @ b + bias, w's gradient kept"), rows[0]
    assert rows[1].source.startswith("x @ w + (x @ a) @ b, w's gradient kept"), rows[1]
    assert not report.left, str(report)


def test_flax_adapter_gradients_equal_with_diff_state():
    # Fine-tuning as flax documents it: only the LoRAParam leaves are differentiated.
    model = _model()
    diff = nnx.DiffState(0, nnx.LoRAParam)
    step = lambda f: nnx.jit(nnx.value_and_grad(f, argnums=diff))  # noqa: E731
    (v0, g0), (v1, g1) = step(flax_loss)(model, X), step(cannjax.optimize(flax_loss))(model, X)
    np.testing.assert_allclose(v1, v0, RTOL, ATOL)
    leaves0, leaves1 = jax.tree.leaves(g0), jax.tree.leaves(g1)
    assert len(leaves0) == len(leaves1) == 4  # lora_a, lora_b of both layers
    for a, b in zip(leaves0, leaves1, strict=True):
        np.testing.assert_allclose(b, a, RTOL, ATOL * float(jnp.abs(a).max()))


def test_flax_full_gradients_equal_when_everything_is_differentiated():
    # Without DiffState every parameter, the frozen kernels included, is differentiated:
    # the substituted operator gives them their true gradient.
    model = _model()
    g0 = nnx.grad(flax_loss)(model, X)
    g1 = nnx.grad(cannjax.optimize(flax_loss))(model, X)
    kernels = 0
    for (p, a), (_, b) in zip(jax.tree.leaves_with_path(g0), jax.tree.leaves_with_path(g1)):
        kernels += "kernel" in jax.tree_util.keystr(p)
        np.testing.assert_allclose(b, a, RTOL, ATOL * float(jnp.abs(a).max()))
    assert kernels == 2


# ------------------------------------------------------------------ memory
def _split_step(model, loss):
    """``(lora, rest, step)``: ``jit(grad)`` over the LoRA parameters only, the rest an
    argument that is not differentiated (what nnx.DiffState does)."""
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

    def of_lora(lora, rest, x):
        return loss(nnx.merge(graphdef, lora, rest), x)

    return lora, rest, of_lora


def test_fewer_residuals_less_temp_and_no_weight_gradient():
    # A wider layer (D = 192, E = 320, rank 8, 512 tokens) so that the figures are
    # activations, not weights.
    d, e = 192, 320

    class Layer(nnx.Module):
        def __init__(self, *, rngs):
            self.proj = nnx.LoRALinear(d, e, lora_rank=8, rngs=rngs)

        def __call__(self, x):
            return self.proj(x)

    def loss(model, x):
        return jnp.mean(jnp.tanh(model(x)))

    model = Layer(rngs=nnx.Rngs(1))
    model.proj.lora.lora_b[...] = jnp.full((8, e), 0.01)
    x = rand.normal(jax.random.key(2), (4, 128, d))
    lora, rest, plain = _split_step(model, loss)
    *_, fast = _split_step(model, cannjax.optimize(loss))
    res = {
        name: cannjax.inspect.residuals(lambda lo, f=f: f(lo, rest, x), lora).total_bytes
        for name, f in (("plain", plain), ("fast", fast))
    }
    compiled = {
        name: jax.jit(jax.grad(f)).lower(lora, rest, x).compile()
        for name, f in (("plain", plain), ("fast", fast))
    }
    temp = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
    # Plain keeps x, x @ a, tanh's output and the output before it; the operator x, the
    # scaled x @ a and tanh's output (the sum is fused into tanh).
    assert res["fast"] < res["plain"], res
    assert temp["fast"] < 0.8 * temp["plain"], temp
    # No [D, E] product in the compiled gradient of either (w is not differentiated; the
    # operator's dw is dead code there).
    pattern = re.compile(rf"f32\[{d},{e}\]\{{[^}}]*\}} dot\(")
    assert not pattern.search(compiled["fast"].as_text())
    gp, gf = jax.jit(jax.grad(plain))(lora, rest, x), jax.jit(jax.grad(fast))(lora, rest, x)
    for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(gf), strict=True):
        np.testing.assert_allclose(b, a, RTOL, ATOL * float(jnp.abs(a).max()))


# ------------------------------------------------------------------ hand-written
def scaled_after(x, w, a, b):
    return x @ w + (x @ a) @ b * 0.5


def scale_first(x, w, a, b):  # s * (x @ a) @ b parses as (s * (x @ a)) @ b
    return x @ w + 0.5 * (x @ a) @ b


def no_scale_bias_first(x, w, a, b):
    return (x @ w + BIAS[None, None]) + (x @ a) @ b


def lora_first_bias_last(x, w, a, b):
    return (x @ a) @ b * 2.0 + x @ w + BIAS.reshape(1, 1, E)


def rank_one_batch(x, w, a, b):  # one token, no batch axes (and no bias)
    return x[0, 0] @ w + (x[0, 0] @ a) @ b * 0.25


FORMS = {
    "(x @ a) @ b * s": (scaled_after, "x @ w + (x @ a) @ b * s, "),
    "s * (x @ a) @ b": (scale_first, "x @ w + (x @ a) @ b * s, "),
    "bias first": (no_scale_bias_first, "x @ w + (x @ a) @ b + bias, "),
    "lora first": (lora_first_bias_last, "x @ w + (x @ a) @ b * s + bias, "),
    "rank-1 x": (rank_one_batch, "x @ w + (x @ a) @ b * s, "),
}


def _hand_loss(f):
    def loss(params, x, w):
        a, b = params
        y = f(x, w, a, b)
        return jnp.sum(jnp.tanh(y) * C[(0,) * (C.ndim - y.ndim)])

    return loss


@pytest.mark.parametrize("name", sorted(FORMS))
def test_hand_written_lora_is_found_and_equal(name):
    f, source = FORMS[name]
    loss = _hand_loss(f)
    report = cannjax.inspect.optimize(loss, (A, B), X, W)
    (row,) = _lora_rows(report)
    assert row.source.startswith(source + "w's gradient kept"), row.source
    fast = cannjax.optimize(loss)
    got = jax.jit(jax.value_and_grad(fast, (0, 2)))((A, B), X, W)
    want = jax.jit(jax.value_and_grad(loss, (0, 2)))((A, B), X, W)
    np.testing.assert_allclose(got[0], want[0], RTOL, ATOL)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, RTOL, ATOL * float(jnp.abs(b).max()))


@pytest.mark.parametrize("how", ["closed over", "stop_gradient"])
def test_constant_w_takes_the_frozen_operator(how):
    if how == "closed over":
        loss = lambda p, x: _hand_loss(scaled_after)(p, x, W)  # noqa: E731
        args = ((A, B), X)
    else:
        loss = lambda p, x, w: _hand_loss(scaled_after)(p, x, jax.lax.stop_gradient(w))  # noqa: E731
        args = ((A, B), X, W)
    (row,) = _lora_rows(cannjax.inspect.optimize(loss, *args))
    assert row.source.startswith("x @ w + (x @ a) @ b * s, w constant"), row.source
    nums = tuple(range(len(args)))
    got = jax.grad(cannjax.optimize(loss), nums)(*args)
    want = jax.grad(loss, nums)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, RTOL, ATOL * max(1.0, float(jnp.abs(b).max())))


# ------------------------------------------------------------------ near misses
def other_x(x, w, a, b):  # the low-rank product reads another x
    return x @ w + ((2.0 * x) @ a) @ b


def traced_scale(x, w, a, b):  # the scale is data
    return x @ w + (x @ a) @ b * jnp.mean(x)


def two_dense(x, w, a, b):  # a dense layer plus a matrix that is not an update of it
    return x @ w + x @ (a @ b)


@pytest.mark.parametrize("f", [other_x, traced_scale, two_dense])
def test_other_sums_are_not_lora(f):
    loss = _hand_loss(f)
    report = cannjax.inspect.optimize(loss, (A, B), X, W)
    assert "lora" not in report.counts(), str(report)
    if f is other_x:
        reasons = [r.source for r in report.left]
        assert any("read different inputs" in s for s in reasons), str(report)
    if f is traced_scale:
        assert any("scale s is not a constant" in r.source for r in report.left), str(report)
    got = jax.grad(cannjax.optimize(loss), (0, 2))((A, B), X, W)
    want = jax.grad(loss, (0, 2))((A, B), X, W)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, RTOL, ATOL * float(jnp.abs(b).max()))


def test_lora_inside_a_larger_sum_is_found_alone():
    def f(x, w, a, b):
        h = x @ w + (x @ a) @ b
        return x[..., :1] + h  # a residual add around it (broadcast, not a bias)

    loss = _hand_loss(f)
    report = cannjax.inspect.optimize(loss, (A, B), X, W)
    assert len(_lora_rows(report)) == 1 and not report.left, str(report)
