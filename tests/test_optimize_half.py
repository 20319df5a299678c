"""optimize on half-precision models: a small transformer layer with bfloat16 or float16
parameters and activations, written as transformers' Flax models write it (statistics and
softmax upcast to float32, cast back), keeps its idioms found and its gradients as close
to the float32 model's as the plain half step's are."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import cannjax
from tests import _rng as rand

B, T, N, H, D, V = 2, 16, 4, 8, 32, 64


def _params(dtype):
    ks = jax.random.split(jax.random.key(0), 5)
    shapes = {"wq": (D, N * H), "wk": (D, N * H), "wv": (D, N * H), "wo": (N * H, D)}
    p = {k: 0.2 * rand.normal(kk, s) for (k, s), kk in zip(shapes.items(), ks)}
    p["g"] = jnp.ones((D,))
    p["head"] = 0.2 * rand.normal(ks[4], (D, V))
    return jax.tree.map(lambda a: a.astype(dtype), p)


X = rand.normal(jax.random.key(1), (B, T, D))
LABELS = rand.randint(jax.random.key(2), (B, T), 0, V)


def rms_norm(x, g):  # upcast, normalize, cast back, scale
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + 1e-6)
    return g[None, None] * y.astype(x.dtype)


def attention(p, h):
    dt = h.dtype
    q, k, v = (jnp.reshape(h @ p[w], (B, T, N, H)) for w in ("wq", "wk", "wv"))
    s = jnp.einsum("bqnh,bknh->bnqk", q, k) / jnp.sqrt(jnp.float32(H)).astype(dt)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, jnp.finfo(dt).min)
    w = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(dt)
    return jnp.einsum("bnqk,bknh->bqnh", w, v).reshape(B, T, N * H) @ p["wo"]


def loss(p, x, labels):
    x = x.astype(p["g"].dtype)
    h = x + attention(p, rms_norm(x, p["g"]))
    z = rms_norm(h, p["g"]) @ p["head"]
    return optax.softmax_cross_entropy_with_integer_labels(z.astype(jnp.float32), labels).mean()


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_model_found_and_as_accurate_as_plain(dtype):
    p = _params(dtype)
    report = cannjax.inspect.optimize(loss, p, X, LABELS)
    assert report.counts() == {"norm": 2, "dense": 4, "attention": 1, "loss": 1}, str(report)
    assert [r.op for r in report.replaced if r.kind == "loss"] == ["linear_cross_entropy"]
    exact = jax.jit(jax.grad(loss))(jax.tree.map(lambda a: a.astype(jnp.float32), p), X, LABELS)
    plain = jax.jit(jax.grad(loss))(p, X, LABELS)
    opt = jax.jit(jax.grad(cannjax.optimize(loss)))(p, X, LABELS)
    for name in exact:
        assert opt[name].dtype == dtype
        err_plain, err_opt = _rel(plain[name], exact[name]), _rel(opt[name], exact[name])
        # Equal in that precision: no further from float32 than the plain half step (the
        # operators keep logits and statistics in float32, so they are often closer).
        assert err_opt <= 1.5 * err_plain + 2 * float(jnp.finfo(dtype).eps), (
            name,
            err_opt,
            err_plain,
        )


# Under cannjax.amp: float32 params cast to the compute dtype inside the step, the loss
# cast back, and the scaled loss's gradients unscaled (a power-of-two scale, so unscaling
# is exact). The idioms are found the same, and the gradients, float32 as the params, are
# as close to the float32 model's as the plain policy step's.
@pytest.mark.parametrize("spec", ["p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32"])
def test_under_an_amp_policy_with_loss_scaling(spec):
    policy = cannjax.amp.get_policy(spec)
    scale = cannjax.amp.DynamicLossScale(jnp.float32(2.0**10))
    step_loss = cannjax.amp.with_policy(loss, policy=policy)

    def grads(f):
        g = jax.jit(jax.grad(lambda p, x, y: scale.scale(f(p, x, y))))(p, X, LABELS)
        return scale.unscale(g)

    p = _params(jnp.float32)
    report = cannjax.inspect.optimize(step_loss, p, X, LABELS)
    assert report.counts() == {"norm": 2, "dense": 4, "attention": 1, "loss": 1}, str(report)
    exact = jax.jit(jax.grad(loss))(p, X, LABELS)
    plain, opt = grads(step_loss), grads(cannjax.optimize(step_loss))
    eps = float(jnp.finfo(policy.compute_dtype).eps)
    for name in exact:
        assert opt[name].dtype == jnp.float32
        err_plain, err_opt = _rel(plain[name], exact[name]), _rel(opt[name], exact[name])
        assert err_opt <= 1.5 * err_plain + 2 * eps, (name, err_opt, err_plain)


# Norms written straight on the half-precision array, as plain JAX models write them:
# jnp.mean and jnp.var sum a bfloat16 array in float32 and round the statistic back, so
# the sums read convert(x) while the rest of the norm reads x.
def _half_layer_norm(x, g, b):
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean(jnp.square(x - m), -1, keepdims=True)
    return (x - m) * lax.rsqrt(v + 1e-5) * g + b


def _half_var_norm(x, g, b):
    m = x.mean(-1, keepdims=True)
    return (x - m) / jnp.sqrt(jnp.var(x, -1, keepdims=True) + 1e-5) * g + b


def _half_rms_norm(x, g, b):
    return x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g + b


@pytest.mark.parametrize("norm", [_half_layer_norm, _half_var_norm, _half_rms_norm])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_norms_on_half_arrays_are_found_and_as_accurate_as_plain(norm, dtype):
    def norm_loss(x, g, b):
        y = norm(x, g, b)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    x = 3.0 + rand.normal(jax.random.key(3), (B, T, D))
    g = 1.0 + 0.1 * rand.normal(jax.random.key(4), (1, 1, D))
    b = 0.1 * rand.normal(jax.random.key(5), (1, 1, D))
    args = tuple(a.astype(dtype) for a in (x, g, b))
    report = cannjax.inspect.optimize(norm_loss, *args)
    assert report.counts() == {"norm": 1} and not report.left, str(report)
    want = "rms_norm" if norm is _half_rms_norm else "layer_norm"
    assert [r.op for r in report.replaced] == [want]
    grad = jax.grad(norm_loss, argnums=(0, 1, 2))
    exact = jax.jit(grad)(x, g, b)
    plain = jax.jit(grad)(*args)
    opt = jax.jit(jax.grad(cannjax.optimize(norm_loss), argnums=(0, 1, 2)))(*args)
    eps = float(jnp.finfo(dtype).eps)
    for o, p, e in zip(opt, plain, exact):
        assert o.dtype == dtype
        assert np.all(np.isfinite(np.asarray(o, np.float32)))
        assert _rel(o, e) <= 1.5 * _rel(p, e) + 2 * eps, (_rel(o, e), _rel(p, e))


# Models whose parameters are cast to bfloat16 while their norms return float32 (penzai,
# dm-haiku, flax.linen under a jmp-style policy) multiply float32 activations by bfloat16
# weights: jnp.matmul and jnp.einsum emit one dot_general of mixed operands, accumulated
# in float32, which converts the weight exactly. optimize reads it as the float32 product
# of the promoted operands: the same math, so the gradients match the plain step's to
# float32 rounding.
def _mixed_attention(p, x):
    q, k = (jnp.reshape(x @ p[w], (B, T, N, H)) for w in ("wq", "wk"))
    v = jnp.reshape(x.astype(jnp.bfloat16) @ p["wv"], (B, T, N, H))  # bf16 v, as linen's
    s = jnp.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(H)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
    w = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bnqk,bknh->bqnh", w, v).reshape(B, T, N * H) @ p["wo"]


def _mixed_loss(p, x):
    h = x + _mixed_attention(p, x)
    return jnp.mean(jnp.sin(jnp.tanh(h @ p["head"])))


def test_float32_activations_times_bfloat16_weights_are_found_and_exact():
    p = _params(jnp.bfloat16)
    report = cannjax.inspect.optimize(_mixed_loss, p, X)
    counts = report.counts()
    assert counts["dense"] == 5 and counts["attention"] == 1, str(report)
    mixed = [e for e in jax.make_jaxpr(_mixed_loss)(p, X).eqns if e.primitive.name == "dot_general"]
    assert any(len({v.aval.dtype for v in e.invars}) == 2 for e in mixed)  # the case tested
    plain = jax.jit(jax.grad(_mixed_loss))(p, X)
    opt = jax.jit(jax.grad(cannjax.optimize(_mixed_loss)))(p, X)
    for name in ("wq", "wk", "wv", "wo", "head"):
        assert opt[name].dtype == jnp.bfloat16
        # Both float32 products of the same bf16 weights: equal but for float32 rounding,
        # which a bf16 gradient's final rounding may show as one ulp.
        assert _rel(opt[name], plain[name]) <= float(jnp.finfo(jnp.bfloat16).eps), name


# penzai's RMS norm of a bfloat16 array with named axes, the features first ([D, B, T]):
# x squared in bf16, summed in float32 over the features where they lie, the mean rounded
# to bf16 and back, x upcast and moved to [B, T, D] for the product. The norm keeps its
# statistic in float32 (two roundings fewer).
def _penzai_style_rms_norm(x, g):
    ms = jnp.sum(jnp.square(x).astype(jnp.float32), 0) / x.shape[0]
    ms = ms.astype(x.dtype).astype(jnp.float32)
    xt = jnp.transpose(x.astype(jnp.float32), (1, 2, 0))
    return xt * lax.rsqrt(ms + 1e-6)[..., None] * g.astype(jnp.float32)[None, None]


# optax's loss of bfloat16 logits against one-hot targets: log_softmax in bf16 (its sum of
# exp in float32, rounded back), upcast, times the targets.
def _one_hot_loss(z, labels):
    return optax.softmax_cross_entropy(z, jax.nn.one_hot(labels, z.shape[-1])).mean()


# transformers' Flax GPT-2 layer norm (flax.linen's) of float32 x with bf16 scale and
# bias (a policy's cast parameters): the variance as mean(x^2) - mean(x)^2 clamped at
# zero, the scale folded into the inverse deviation, the parameters reshaped, then upcast.
def _flax_style_layer_norm(x, g, b, floor=0.0):
    m = jnp.mean(x, -1)
    var = jnp.maximum(floor, jnp.mean(jnp.square(x), -1) - jnp.square(m))
    mul = lax.rsqrt(var[..., None] + 1e-5) * g.reshape(1, 1, -1).astype(jnp.float32)
    return (x - m[..., None]) * mul + b.reshape(1, 1, -1).astype(jnp.float32)


def _edge_case_args():
    x = 3.0 + rand.normal(jax.random.key(3), (B, T, D))
    g = 1.0 + 0.1 * rand.normal(jax.random.key(4), (D,))
    b = 0.1 * rand.normal(jax.random.key(5), (D,))
    return x, g, b


def _as_accurate_as_plain(f, args, half_args, argnums):
    grad = jax.grad(f, argnums=argnums)
    exact, plain = jax.jit(grad)(*args), jax.jit(grad)(*half_args)
    opt = jax.jit(jax.grad(cannjax.optimize(f), argnums=argnums))(*half_args)
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    for o, p, e in zip(opt, plain, exact):
        assert o.dtype == p.dtype
        assert np.all(np.isfinite(np.asarray(o, np.float32)))
        assert _rel(o, e) <= 1.5 * _rel(p, e) + 2 * eps, (_rel(o, e), _rel(p, e))


def test_a_norm_whose_statistic_is_rounded_to_bfloat16_is_found():
    def f(x, g):
        return jnp.sum(jnp.sin(_penzai_style_rms_norm(x, g)))

    x, g, _ = _edge_case_args()
    x = jnp.transpose(x, (2, 0, 1))  # [D, B, T]
    half = (x.astype(jnp.bfloat16), g.astype(jnp.bfloat16))
    report = cannjax.inspect.optimize(f, *half)
    assert [r.op for r in report.replaced] == ["rms_norm"] and not report.left, str(report)
    _as_accurate_as_plain(f, (x, g), half, (0, 1))


def test_optax_loss_of_bfloat16_logits_and_one_hot_targets_is_found():
    z = 2.0 * rand.normal(jax.random.key(6), (B, T, V))
    half = (z.astype(jnp.bfloat16), LABELS)
    report = cannjax.inspect.optimize(_one_hot_loss, *half)
    assert report.counts() == {"loss": 1} and not report.left, str(report)
    _as_accurate_as_plain(_one_hot_loss, (z, LABELS), half, (0,))


def test_a_layer_norm_with_its_variance_clamped_at_zero_is_found():
    def f(x, g, b):
        return jnp.sum(jnp.sin(_flax_style_layer_norm(x, g, b)))

    x, g, b = _edge_case_args()
    half = (x, g.astype(jnp.bfloat16), b.astype(jnp.bfloat16))
    report = cannjax.inspect.optimize(f, *half)
    assert [r.op for r in report.replaced] == ["layer_norm"] and not report.left, str(report)
    assert report.replaced[0].source == "layer norm (verified by evaluation)"  # no template
    _as_accurate_as_plain(f, (x, g, b), half, (0, 1, 2))


@pytest.mark.parametrize("floor", [0.0, 1e-3])
def test_only_a_clamp_at_zero_keeps_a_norm(floor):
    # max(1e-3, var) changes the function wherever the variance is small: not a norm.
    def f(x, g, b):
        return jnp.sum(jnp.sin(_flax_style_layer_norm(x, g, b, floor)))

    x, g, b = _edge_case_args()
    report = cannjax.inspect.optimize(f, x, g.astype(jnp.bfloat16), b.astype(jnp.bfloat16))
    found = [r.source for r in report.replaced if r.kind == "norm"]
    assert found == (["layer norm (verified by evaluation)"] if floor == 0.0 else []), found


# The same mix in a gated MLP and in the head before a loss: each still one operator.
def _mixed_block_loss(p, x, labels):
    h = jax.nn.silu(x @ p["wg"]) * (x @ p["wu"])  # float32 x times bfloat16 weights
    z = (x + h @ p["wd"]) @ p["head"]
    return optax.softmax_cross_entropy_with_integer_labels(z, labels).mean()


def test_a_gated_mlp_and_a_head_of_mixed_products_are_found():
    ks = jax.random.split(jax.random.key(7), 4)
    shapes = {"wg": (D, 2 * D), "wu": (D, 2 * D), "wd": (2 * D, D), "head": (D, V)}
    p = {
        k: (0.2 * rand.normal(kk, s)).astype(jnp.bfloat16) for (k, s), kk in zip(shapes.items(), ks)
    }
    report = cannjax.inspect.optimize(_mixed_block_loss, p, X, LABELS)
    ops_found = sorted(r.op for r in report.replaced)
    assert ops_found == ["linear_cross_entropy", "swiglu"] and not report.left, str(report)
    plain = jax.jit(jax.grad(_mixed_block_loss))(p, X, LABELS)
    opt = jax.jit(jax.grad(cannjax.optimize(_mixed_block_loss)))(p, X, LABELS)
    for name in p:
        assert opt[name].dtype == jnp.bfloat16
        assert _rel(opt[name], plain[name]) <= float(jnp.finfo(jnp.bfloat16).eps), name


def _half_causal_bias():
    """transformers' bias: ``lax.select(mask, full(0).astype(bf16), full(min).astype(bf16))``."""
    causal = jnp.tril(jnp.ones((1, 1, T, T), bool))
    fill = jnp.full(causal.shape, jnp.finfo(jnp.bfloat16).min).astype(jnp.bfloat16)
    return lax.select(causal, jnp.full(causal.shape, 0.0).astype(jnp.bfloat16), fill)


# Attention as transformers' Flax models compute it under `dtype=jnp.bfloat16`: bfloat16
# heads, q and k upcast for float32 logits (flax's dot_product_attention_weights with
# dtype=float32), keys repeated per query group after the upcast or before it, a
# bfloat16 `0 / finfo.min` mask bias widened and added, the probabilities cast back to
# bfloat16 for p v. The float32 product of exactly upcast heads is the operator's own
# (half operands, logits accumulated in float32).
def _upcast_logits_attention(x, w, repeat_before_upcast=True):
    q, k, v = (jnp.reshape(x @ w[i], (B, T, N // 2 if i else N, H)) for i in range(3))
    k, v = jnp.repeat(k, 2, axis=2) if repeat_before_upcast else k, jnp.repeat(v, 2, axis=2)
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    k = k if repeat_before_upcast else jnp.repeat(k, 2, axis=2)
    bias = _half_causal_bias()
    s = jnp.einsum("bqnh,bknh->bnqk", q / np.sqrt(H), k) + bias.astype(jnp.float32)
    p = jax.nn.softmax(s, axis=-1).astype(jnp.bfloat16)
    return jnp.einsum("bnqk,bknh->bqnh", p, v).reshape(B, T, N * H)


# GPT-2's: the same bfloat16 mask bias added to bfloat16 logits.
def _half_logits_attention(x, w):
    q, k, v = (jnp.reshape(x @ w[i], (B, T, N, H)) for i in range(3))
    bias = _half_causal_bias()
    s = jnp.einsum("bqnh,bknh->bnqk", q / jnp.bfloat16(np.sqrt(H)), k) + bias
    p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(jnp.bfloat16)
    return jnp.einsum("bnqk,bknh->bqnh", p, v).reshape(B, T, N * H)


@pytest.mark.parametrize(
    "attention",
    [
        _upcast_logits_attention,
        lambda x, w: _upcast_logits_attention(x, w, repeat_before_upcast=False),
        _half_logits_attention,
    ],
    ids=["upcast-q-k", "upcast-then-repeat", "half-logits-half-bias"],
)
def test_attention_of_bfloat16_heads_with_a_bfloat16_mask_bias_is_found(attention):
    def f(x, *w):
        return jnp.sum(jnp.sin(attention(x, w).astype(jnp.float32)))

    ks = jax.random.split(jax.random.key(8), 3)
    kv = N * H // (1 if attention is _half_logits_attention else 2)
    w = (0.2 * rand.normal(ks[0], (D, N * H)), *(0.2 * rand.normal(k, (D, kv)) for k in ks[1:]))
    args = (X, *w)
    half = tuple(a.astype(jnp.bfloat16) for a in args)
    report = cannjax.inspect.optimize(f, *half)
    assert report.counts().get("attention") == 1, str(report)
    assert not any("attention" in r.source for r in report.left), str(report)
    _as_accurate_as_plain(f, args, half, (0, 1, 2, 3))
