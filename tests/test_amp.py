"""cannjax.amp: policies, loss scales, loss-scaled value_and_grad, skip_nonfinite."""

import dataclasses
import io
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec

from cannjax import amp
from tests import _rng as rand

F16_MAX = 65504.0


# ----------------------------------------------------------------------------- policies
@pytest.mark.parametrize(
    "spec,expected",
    [
        ("params=float32,compute=float16,output=float32", ("float32", "float16", "float32")),
        ("p=f32,c=bf16,o=f32", ("float32", "bfloat16", "float32")),
        ("c=f16", ("float32", "float16", "float16")),  # output follows compute
        ("p=f16", ("float16", "float16", "float16")),  # compute follows params
        ("full", ("float32", "float32", "float32")),
        ("bf16", ("bfloat16", "bfloat16", "bfloat16")),
        (" P = F32 , C = F16 ", ("float32", "float16", "float16")),
    ],
)
def test_get_policy_parses(spec, expected):
    p = amp.get_policy(spec)
    assert (p.param_dtype.name, p.compute_dtype.name, p.output_dtype.name) == expected


def test_half_resolves_per_platform():
    assert amp.half_dtype("ascend") == jnp.float16
    assert amp.half_dtype("ASCEND") == jnp.float16
    # only the configured Ascend name is special (tests/test_platform.py)
    for platform in ("cpu", "gpu", "tpu", "cuda", "npu"):
        assert amp.half_dtype(platform) == jnp.bfloat16
    assert amp.half_dtype() == jnp.bfloat16  # this suite runs on cpu
    assert str(amp.get_policy("half", platform="ascend")) == (
        "params=float16,compute=float16,output=float16"
    )
    assert str(amp.get_policy("mixed", platform="cpu")) == (
        "params=float32,compute=bfloat16,output=float32"
    )
    assert amp.get_policy("p=f32,c=half", platform="ascend").compute_dtype == jnp.float16


@pytest.mark.parametrize(
    "spec,exc,words",
    [
        ("params=float32,compute=float8", ValueError, ["float8", "compute"]),
        ("weights=float32", ValueError, ["unknown key 'weights'"]),
        ("p=f32,p=f16", ValueError, ["given twice"]),
        ("p=", ValueError, ["malformed"]),
        ("quarter", ValueError, ["unknown policy 'quarter'"]),
        ("p=int32", ValueError, ["int32"]),
        (3, TypeError, ["spec must be"]),
    ],
)
def test_get_policy_bad_input(spec, exc, words):
    with pytest.raises(exc, match="cannjax.amp.get_policy") as e:
        amp.get_policy(spec)
    for w in words:
        assert w in str(e.value)


def test_policy_rejects_non_float_dtypes():
    with pytest.raises(TypeError, match="compute_dtype must be a floating dtype.*int32"):
        amp.Policy(jnp.float32, jnp.int32, jnp.float32)
    with pytest.raises(TypeError, match="cannjax.amp.cast_floating: dtype.*bool"):
        amp.cast_floating({}, jnp.bool_)


def test_casts_touch_only_floating_leaves():
    p = amp.get_policy("p=f32,c=f16,o=bf16")
    tree = {"w": jnp.ones(2), "ids": jnp.arange(3), "mask": jnp.ones(2, bool), "n": 3, "f": 0.5}
    out = p.cast_to_compute(tree)
    assert out["w"].dtype == jnp.float16
    assert out["ids"].dtype == jnp.int32 and out["mask"].dtype == jnp.bool_
    assert out["n"] == 3 and out["f"] == 0.5  # Python numbers stay weakly typed
    assert p.cast_to_output(out)["w"].dtype == jnp.bfloat16
    assert p.cast_to_param(out)["w"].dtype == jnp.float32
    assert p.with_output_dtype("f32").output_dtype == jnp.float32


def test_with_policy_computes_in_compute_dtype_and_grads_come_back_in_param_dtype():
    seen = []

    def f(w, x, ids):
        seen.append((w.dtype, x.dtype, ids.dtype))
        return jnp.sum(x @ w)

    g = amp.with_policy(f, policy="params=float32,compute=float16,output=float32")
    assert g.__name__ == "f"  # functools.wraps
    w, x = jnp.full((3, 2), 0.5), jnp.ones((4, 3))
    out, grad = jax.value_and_grad(g)(w, x, jnp.arange(2))
    assert seen[-1] == (jnp.float16, jnp.float16, jnp.int32)
    assert out.dtype == jnp.float32 and grad.dtype == jnp.float32
    np.testing.assert_allclose(out, 12.0)
    np.testing.assert_allclose(grad, jnp.full((3, 2), 4.0))
    with pytest.raises(TypeError, match="cannjax.amp.with_policy: fun must be callable"):
        amp.with_policy(3, policy="full")


# ------------------------------------------------------------------------- loss scales
def test_dynamic_defaults():
    ls = amp.DynamicLossScale()
    assert float(ls.loss_scale) == 2.0**15 and ls.loss_scale.dtype == jnp.float32
    assert (ls.growth_factor, ls.backoff_factor, ls.growth_interval) == (2.0, 0.5, 2000)
    assert (ls.min_loss_scale, ls.max_loss_scale) == (1.0, 2.0**24)
    assert int(ls.counter) == 0 and int(ls.min_scale_overflows) == 0


def test_every_field_survives_jit():
    ls = amp.DynamicLossScale(
        64.0,
        growth_interval=7,
        growth_factor=4.0,
        backoff_factor=0.25,
        min_loss_scale=2.0,
        max_loss_scale=2.0**10,
    )
    ls = dataclasses.replace(ls, counter=jnp.int32(3), min_scale_overflows=jnp.int32(5))
    out = jax.jit(lambda s: s)(ls)
    for f in dataclasses.fields(ls):
        np.testing.assert_array_equal(getattr(out, f.name), getattr(ls, f.name), err_msg=f.name)
    # and through adjust inside jit: the non-default min bounds the backoff
    small = amp.DynamicLossScale(4.0, min_loss_scale=2.0)
    step = jax.jit(lambda s: s.adjust(jnp.array(False)))
    small = step(step(step(small)))
    assert small.min_loss_scale == 2.0 and float(small.loss_scale) == 2.0
    static = jax.jit(lambda s: s)(amp.StaticLossScale(512.0))
    assert float(static.loss_scale) == 512.0


def test_pytree_leaves_and_static_fields():
    ls = amp.DynamicLossScale(8.0, growth_interval=5)
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    assert len(leaves) == 3  # loss_scale, counter, min_scale_overflows
    assert jax.tree_util.tree_leaves(amp.NoOpLossScale()) == []
    assert len(jax.tree_util.tree_leaves(amp.StaticLossScale(2.0))) == 1
    other = jax.tree_util.tree_structure(amp.DynamicLossScale(8.0, growth_interval=6))
    assert treedef != other  # hyperparameters live in the treedef
    # stacked states (an ensemble) unflatten too, and adjust elementwise under vmap
    stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs), ls, ls.adjust(jnp.array(False)))
    assert np.asarray(stacked.loss_scale).tolist() == [8.0, 4.0]
    grown = jax.vmap(lambda s: s.adjust(jnp.array(True)))(stacked)
    assert np.asarray(grown.counter).tolist() == [1, 1]


def test_grows_exactly_every_growth_interval_finite_steps():
    ls = amp.DynamicLossScale(8.0, growth_interval=3)
    adjust = jax.jit(lambda s, ok: s.adjust(ok))
    t, f = jnp.array(True), jnp.array(False)
    history = []
    for ok in [t, t, t, t, t, t, f, t, t, t]:
        ls = adjust(ls, ok)
        history.append(float(ls.loss_scale))
    # growth at the 3rd and 6th finite step, backoff at the overflow, then 3 more finite
    assert history == [8, 8, 16, 16, 16, 32, 16, 16, 16, 32]
    one = amp.DynamicLossScale(8.0, growth_interval=1)
    assert float(one.adjust(t).loss_scale) == 16.0


def test_never_inf_never_below_min():
    t, f = jnp.array(True), jnp.array(False)
    big = amp.DynamicLossScale(2.0**24, growth_interval=1)
    for _ in range(3):
        big = big.adjust(t)
    assert float(big.loss_scale) == 2.0**24
    huge = float(np.finfo(np.float32).max)
    top = amp.DynamicLossScale(huge, growth_interval=1, max_loss_scale=huge).adjust(t)
    assert np.isfinite(float(top.loss_scale)) and float(top.loss_scale) == huge
    low = amp.DynamicLossScale(3.0, min_loss_scale=1.5, backoff_factor=0.1)
    for _ in range(4):
        low = low.adjust(f)
    assert float(low.loss_scale) == 1.5


def test_overflow_at_min_scale_is_flagged_and_reset():
    ls = amp.DynamicLossScale(2.0, min_loss_scale=1.0)
    t, f = jnp.array(True), jnp.array(False)
    ls = ls.adjust(f)  # 2 -> 1: a normal backoff, not yet stuck
    assert int(ls.min_scale_overflows) == 0 and not bool(ls.overflowed_at_min)
    ls = ls.adjust(f).adjust(f)  # overflowing at the minimum, twice
    assert int(ls.min_scale_overflows) == 2 and bool(ls.overflowed_at_min)
    with pytest.warns(amp.LossScaleWarning, match="minimum loss scale"):
        report = amp.check_loss_scale(ls)
    assert report == {"loss_scale": 1.0, "counter": 0, "min_scale_overflows": 2, "stuck": True}
    with pytest.raises(FloatingPointError, match="2 consecutive"):
        amp.check_loss_scale(ls, strict=True)
    assert int(ls.adjust(t).min_scale_overflows) == 0


def test_float16_scale_is_stored_in_float32():
    ls = amp.DynamicLossScale(jnp.float16(1024.0))
    assert ls.loss_scale.dtype == jnp.float32
    # a float32 scale above the float16 maximum still scales a float16 loss exactly
    big = amp.StaticLossScale(2.0**20)
    out = big.scale(jnp.float16(0.5))
    assert out.dtype == jnp.float32 and float(out) == 2.0**19


def test_scale_and_unscale():
    ls = amp.StaticLossScale(1024.0)
    g = {"a": jnp.array([1e-7], jnp.float16) * 1024, "b": jnp.array([2048.0], jnp.float32)}
    out = ls.unscale(g)
    assert out["a"].dtype == jnp.float32  # 1e-7 is subnormal in float16, normal here
    np.testing.assert_array_equal(out["a"], np.asarray(g["a"]).astype(np.float32) / 1024)
    assert out["b"].dtype == jnp.float32 and float(out["b"][0]) == 2.0
    assert amp.NoOpLossScale().unscale(jnp.ones(2, jnp.bfloat16)).dtype == jnp.float32
    with pytest.raises(TypeError, match="cannjax.amp.scale: every leaf must be floating"):
        ls.scale(jnp.arange(3))


@pytest.mark.parametrize(
    "make,exc,words",
    [
        (lambda: amp.DynamicLossScale(0.0), ValueError, "loss_scale must be finite and > 0"),
        (lambda: amp.DynamicLossScale(-4.0), ValueError, "loss_scale must be finite and > 0"),
        (lambda: amp.DynamicLossScale(float("inf")), ValueError, "loss_scale"),
        (lambda: amp.DynamicLossScale(2.0**30), ValueError, "must lie in"),
        (lambda: amp.DynamicLossScale(growth_factor=1.0), ValueError, "growth_factor must be > 1"),
        (lambda: amp.DynamicLossScale(backoff_factor=1.0), ValueError, "backoff_factor"),
        (lambda: amp.DynamicLossScale(backoff_factor=0.0), ValueError, "backoff_factor"),
        (lambda: amp.DynamicLossScale(growth_interval=0), ValueError, "growth_interval"),
        (lambda: amp.DynamicLossScale(growth_interval=2.5), TypeError, "growth_interval"),
        (lambda: amp.DynamicLossScale(min_loss_scale=0.0), ValueError, "min_loss_scale"),
        (
            lambda: amp.DynamicLossScale(min_loss_scale=8.0, max_loss_scale=4.0, loss_scale=4.0),
            ValueError,
            "min_loss_scale=8.0 must be <= max_loss_scale=4.0",
        ),
        (lambda: amp.DynamicLossScale(max_loss_scale=float("inf")), ValueError, "max_loss_scale"),
        (lambda: amp.DynamicLossScale(jnp.int32(4)), TypeError, "loss_scale must be a floating"),
        (lambda: amp.DynamicLossScale(True), TypeError, "loss_scale"),
        (lambda: amp.DynamicLossScale(counter=-1), ValueError, "counter must be >= 0"),
        (lambda: amp.StaticLossScale(0.0), ValueError, "StaticLossScale: loss_scale"),
        (lambda: amp.StaticLossScale("big"), TypeError, "StaticLossScale: loss_scale"),
    ],
)
def test_loss_scale_bad_input(make, exc, words):
    with pytest.raises(exc, match="cannjax.amp") as e:
        make()
    assert words in str(e.value)


def test_adjust_needs_a_boolean_scalar():
    for ls in (amp.DynamicLossScale(), amp.StaticLossScale(2.0), amp.NoOpLossScale()):
        with pytest.raises(TypeError, match="adjust: grads_finite must be a boolean scalar"):
            ls.adjust(jnp.ones(2, bool))
        with pytest.raises(TypeError, match="grads_finite"):
            ls.adjust(jnp.float32(1.0))


def test_state_round_trips_through_flatten_and_numpy_files():
    ls = amp.DynamicLossScale(256.0, growth_interval=4, min_loss_scale=2.0)
    for ok in (True, True, False, True, True):
        ls = ls.adjust(jnp.array(ok))
    opt = amp.skip_nonfinite(optax.adam(1e-2))
    params = {"w": jnp.arange(3.0)}
    state = opt.init(params)
    state = opt.update({"w": jnp.array([jnp.nan, 1.0, 2.0])}, state, params)[1]
    train_state = {"loss_scale": ls, "opt": state, "params": params}
    leaves, treedef = jax.tree_util.tree_flatten(train_state)
    buf = io.BytesIO()
    np.savez(buf, *[np.asarray(x) for x in leaves])
    buf.seek(0)
    loaded = np.load(buf)
    restored = jax.tree_util.tree_unflatten(
        treedef, [loaded[f"arr_{i}"] for i in range(len(leaves))]
    )
    for a, b in zip(jax.tree_util.tree_leaves(restored), leaves):
        np.testing.assert_array_equal(a, b)
    r = restored["loss_scale"]
    assert (float(r.loss_scale), int(r.counter), r.min_loss_scale) == (128.0, 2, 2.0)
    assert int(restored["opt"].num_skipped) == 1
    # training continues identically from the restored state
    np.testing.assert_array_equal(
        r.adjust(jnp.array(True)).adjust(jnp.array(True)).loss_scale,
        ls.adjust(jnp.array(True)).adjust(jnp.array(True)).loss_scale,
    )


# ------------------------------------------------------------------------ overflow checks
def test_overflow_checks():
    ok = {"a": jnp.ones((4, 4)), "ids": jnp.arange(3)}
    assert bool(amp.all_finite(ok)) and bool(amp.all_finite({}))
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        tree = {"a": jnp.ones((4, 4)).at[2, 3].set(bad)}
        assert not bool(jax.jit(amp.all_finite)(tree))
        assert not bool(jax.jit(amp.saturation_check())(tree))
    # saturation mode: an overflow became the float16 maximum, which isfinite misses
    saturated = {"a": jnp.ones((4, 4), jnp.float16).at[1, 1].set(-F16_MAX)}
    assert bool(amp.all_finite(saturated))
    assert not bool(amp.saturation_check("float16")(saturated))
    assert not bool(amp.saturation_check()({"a": saturated["a"].astype(jnp.float32)}))
    assert bool(amp.saturation_check()({"a": jnp.full(3, 60000.0, jnp.float16)}))
    assert amp.default_overflow_check("cpu") is amp.all_finite
    assert not bool(amp.default_overflow_check("ascend")(saturated))
    with pytest.raises(TypeError, match="cannjax.amp.saturation_check: dtype"):
        amp.saturation_check(jnp.int8)


# ---------------------------------------------------------------------- value_and_grad
def _quad(w, x):
    return jnp.sum((x @ w) ** 2)


def test_value_and_grad_matches_jax_in_float32():
    w, x = jnp.arange(6.0).reshape(3, 2) / 7, jnp.ones((4, 3))
    value, grads = jax.value_and_grad(_quad)(w, x)
    for ls in (amp.NoOpLossScale(), amp.StaticLossScale(64.0), amp.DynamicLossScale()):
        r = jax.jit(amp.value_and_grad(_quad, ls))(w, x)
        assert isinstance(r, amp.AmpResult) and bool(r.grads_finite)
        np.testing.assert_array_equal(r.value, value)
        np.testing.assert_allclose(r.grads, grads, rtol=1e-6)
    r = amp.value_and_grad(_quad, amp.StaticLossScale(8.0), argnums=(0, 1))(w, x)
    np.testing.assert_allclose(r.grads[1], jax.grad(_quad, argnums=1)(w, x), rtol=1e-6)
    aux_fn = lambda w, x: (_quad(w, x), {"n": x.shape[0]})  # noqa: E731
    (loss, aux), g, _, _ = amp.value_and_grad(aux_fn, amp.DynamicLossScale(), has_aux=True)(w, x)
    assert aux == {"n": 4}
    np.testing.assert_allclose(loss, value)


def test_loss_scaling_rescues_float16_underflow():
    w = jnp.full((8, 8), 0.1)
    x = jnp.ones((4, 8))

    def loss(w):
        h = amp.with_policy(lambda w, x: x @ w, policy="p=f32,c=f16,o=f32")(w, x)
        return 1e-6 * jnp.mean(h**2) / 64

    exact = jax.grad(lambda w: 1e-6 * jnp.mean((x @ w) ** 2) / 64)(w)
    unscaled = amp.value_and_grad(loss, amp.NoOpLossScale())(w)
    scaled = amp.value_and_grad(loss, amp.DynamicLossScale())(w)
    assert float(jnp.max(jnp.abs(exact))) > 0
    assert int(jnp.sum(unscaled.grads != 0)) == 0  # flushed to zero in float16
    assert bool(scaled.grads_finite) and scaled.grads.dtype == jnp.float32
    np.testing.assert_allclose(scaled.grads, exact, rtol=2e-3)


def test_overflow_poisons_grads_and_backs_off():
    def loss(w):  # the float16 backward overflows at scale 2**15: d/dw = 2 w * 1e4
        return (1e4 * jnp.sum(w.astype(jnp.float16) ** 2)).astype(jnp.float32)

    ls = amp.DynamicLossScale(2.0**15)
    r = jax.jit(amp.value_and_grad(loss, ls))(jnp.ones(3))
    assert not bool(r.grads_finite)
    assert bool(jnp.all(jnp.isnan(r.grads)))  # every leaf, so no check can disagree
    assert float(r.loss_scale.loss_scale) == 2.0**14 and int(r.loss_scale.counter) == 0
    assert float(r.value) == 3e4  # the value is the unscaled loss


def test_saturation_check_inside_value_and_grad():
    # A saturation-mode device returns +-65504 instead of inf: emulate with a clip.
    @jax.custom_vjp
    def saturating(x):
        return x

    saturating.defvjp(
        lambda x: (x, None), lambda _, g: (jnp.clip(g, -F16_MAX, F16_MAX).astype(g.dtype),)
    )

    def loss(w):
        return (1e4 * jnp.sum(saturating(w.astype(jnp.float16)) ** 2)).astype(jnp.float32)

    ls = amp.DynamicLossScale(2.0**15)
    assert bool(amp.value_and_grad(loss, ls, overflow_check=amp.all_finite)(jnp.ones(2))[3])
    check = amp.saturation_check("float16")
    r = amp.value_and_grad(loss, ls, overflow_check=check)(jnp.ones(2))
    assert not bool(r.grads_finite) and float(r.loss_scale.loss_scale) == 2.0**14


def test_all_devices_agree_on_the_finite_flag():
    n = jax.device_count()
    assert n >= 2, "conftest sets 8 cpu devices"
    mesh = Mesh(np.array(jax.devices()), ("data",))
    x = jnp.ones((n, 2)).at[n - 1, 0].set(jnp.inf)  # only the last shard overflows

    def local(w, x, axis_name):
        # w is per-device (varying): its gradient is local, not summed by shard_map
        r = amp.value_and_grad(
            lambda w: jnp.sum(w[0] * x[0]), amp.DynamicLossScale(), axis_name=axis_name
        )(w)
        return r.grads_finite[None], r.loss_scale.loss_scale[None]

    def run(axis_name):
        f = jax.shard_map(
            lambda w, x: local(w, x, axis_name),
            mesh=mesh,
            in_specs=(PartitionSpec("data"), PartitionSpec("data")),
            out_specs=PartitionSpec("data"),
        )
        return jax.jit(f)(jnp.ones((n, 2)), x)

    ok, scale = run("data")
    assert not np.any(np.asarray(ok)) and np.all(np.asarray(scale) == 2.0**14)
    ok_local, _ = run(None)  # without axis_name the devices disagree
    assert np.asarray(ok_local).tolist() == [True] * (n - 1) + [False]


def test_value_and_grad_bad_input():
    ls = amp.DynamicLossScale()
    with pytest.raises(TypeError, match="cannjax.amp.value_and_grad: loss_scale must be"):
        amp.value_and_grad(_quad, 1024.0)
    with pytest.raises(TypeError, match="cannjax.amp.value_and_grad: fun must be callable"):
        amp.value_and_grad(None, ls)
    with pytest.raises(TypeError, match="argnums must be an int"):
        amp.value_and_grad(_quad, ls, argnums="0")
    with pytest.raises(TypeError, match="overflow_check must be a callable"):
        amp.value_and_grad(_quad, ls, overflow_check="isfinite")
    with pytest.raises(TypeError, match="must return a floating scalar loss, got 'float32\\[3\\]'"):
        amp.value_and_grad(lambda w: w * 2, ls)(jnp.ones(3))
    with pytest.raises(TypeError, match="has_aux=True needs fun to return"):
        amp.value_and_grad(lambda w: jnp.sum(w), ls, has_aux=True)(jnp.ones(3))


def test_stuck_at_min_warns_through_the_callback():
    def loss(w):
        return jnp.sum(w * jnp.inf)

    ls = amp.DynamicLossScale(1.0, min_loss_scale=1.0)
    step = jax.jit(lambda ls, w: amp.value_and_grad(loss, ls, warn=True)(w).loss_scale)
    with pytest.warns(amp.LossScaleWarning, match="minimum loss scale"):
        ls = step(ls, jnp.ones(2))
        jax.effects_barrier()
    assert int(ls.min_scale_overflows) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", amp.LossScaleWarning)
        quiet = jax.jit(lambda ls, w: amp.value_and_grad(loss, ls)(w).loss_scale)
        assert int(quiet(ls, jnp.ones(2)).min_scale_overflows) == 2  # flag, no warning
        jax.effects_barrier()


# ---------------------------------------------------------------------- skip_nonfinite
def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize("mode", ["cond", "select"])
def test_injected_inf_leaves_params_and_state_bit_identical(mode):
    sched = optax.linear_schedule(1e-2, 0.0, 10)
    opt = amp.skip_nonfinite(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(sched)), mode=mode
    )
    params = {"w": jnp.array([1.0, -0.0, 3.0]), "b": jnp.array([0.5])}
    state = opt.init(params)
    step = jax.jit(lambda g, s, p: opt.update(g, s, p))
    step_flag = jax.jit(lambda g, s, p, ok: opt.update(g, s, p, grads_finite=ok))
    good = {"w": jnp.array([0.1, 0.2, 0.3]), "b": jnp.array([0.4])}
    u, state = step(good, state, params)
    params = optax.apply_updates(params, u)
    before = _bits((params, state.inner_state))
    bad = {"w": jnp.array([0.1, jnp.inf, 0.3]), "b": jnp.array([0.4])}
    u, new_state = step(bad, state, params)
    new_params = optax.apply_updates(params, u)
    assert _bits((new_params, new_state.inner_state)) == before
    assert int(new_state.num_skipped) == 1 and int(new_state.consecutive_skipped) == 1
    assert not bool(new_state.last_finite)
    # the schedule did not advance: the next good step equals the one without the skip
    u1, s1 = step(good, new_state, new_params)
    u2, s2 = step(good, state, params)
    assert _bits((u1, s1.inner_state)) == _bits((u2, s2.inner_state))
    assert int(s1.consecutive_skipped) == 0 and int(s1.num_skipped) == 1
    # the flag from value_and_grad replaces the second check
    u3, s3 = step_flag(good, state, params, jnp.array(False))
    assert _bits((optax.apply_updates(params, u3), s3.inner_state)) == before
    u4, s4 = step_flag(good, state, params, jnp.array(True))
    assert _bits((u4, s4.inner_state)) == _bits((u2, s2.inner_state))
    with pytest.raises(TypeError, match="grads_finite must be a boolean scalar"):
        opt.update(good, state, params, grads_finite=jnp.ones(2, bool))


@pytest.mark.parametrize("mode", ["cond", "select"])
def test_finite_step_equals_inner_step(mode):
    inner = optax.adam(1e-2)
    opt = amp.skip_nonfinite(inner, mode=mode)
    params = {"w": jnp.arange(4.0)}
    g = {"w": jnp.array([0.3, -0.1, 0.0, 2.0])}
    u, s = opt.update(g, opt.init(params), params)
    u_ref, s_ref = inner.update(g, inner.init(params), params)
    assert _bits((u, s.inner_state)) == _bits((u_ref, s_ref))


def _micro_step(opt):
    def micro(state, params, x):
        r = amp.value_and_grad(lambda p: jnp.sum(p * x), amp.DynamicLossScale())(params)
        u, state = opt.update(r.grads, state, params)
        return optax.apply_updates(params, u), state

    return jax.jit(micro)


def test_multisteps_outside_drops_the_overflowing_micro_batch():
    k = 3
    opt = amp.skip_nonfinite(optax.MultiSteps(optax.sgd(0.5), every_k_schedule=k))
    params = jnp.zeros(2)
    state = opt.init(params)
    micro = _micro_step(opt)
    ones, twos, bad = jnp.ones(2), jnp.full(2, 2.0), jnp.array([1.0, jnp.inf])
    for x in (ones, bad, twos):  # the bad micro-batch never reaches the accumulator
        params, state = micro(state, params, x)
    assert np.asarray(params).tolist() == [0.0, 0.0]
    assert int(state.num_skipped) == 1 and int(state.inner_state.mini_step) == 2
    params, state = micro(state, params, ones)  # k finite micro-batches: one step
    np.testing.assert_allclose(params, -0.5 * (1 + 2 + 1) / 3 * np.ones(2), rtol=1e-6)
    for x in (ones, ones, ones):  # and training goes on
        params, state = micro(state, params, x)
    np.testing.assert_allclose(params, -0.5 * (4 / 3 + 1) * np.ones(2), rtol=1e-6)


def test_multisteps_inside_is_poisoned_forever_by_optax_reset():
    # Documented pitfall: optax.MultiSteps resets its accumulator as 0 * acc, and
    # 0 * NaN is NaN, so after one non-finite micro-batch every later effective batch is
    # non-finite. skip_nonfinite still applies nothing, and says so in its counters.
    opt = optax.MultiSteps(amp.skip_nonfinite(optax.sgd(0.5)), every_k_schedule=2)
    params = jnp.zeros(2)
    state = opt.init(params)
    micro = _micro_step(opt)
    for x in [jnp.array([1.0, jnp.inf])] + [jnp.ones(2)] * 5:
        params, state = micro(state, params, x)
    assert np.asarray(params).tolist() == [0.0, 0.0]
    assert int(state.inner_opt_state.consecutive_skipped) == 3


def test_float16_gradients_are_loud():
    opt = amp.skip_nonfinite(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)))
    params = jnp.ones(2, jnp.float16)
    with pytest.raises(TypeError, match="must be unscaled in float32 before the optimizer"):
        opt.update(jnp.ones(2, jnp.float16) * 1024, opt.init(params), params)
    ok = amp.skip_nonfinite(optax.sgd(0.1), allow_float16_updates=True)
    u, _ = ok.update(jnp.ones(2, jnp.float16), ok.init(params), params)
    assert u.dtype == jnp.float16


def test_skip_nonfinite_bad_input():
    with pytest.raises(TypeError, match="cannjax.amp.skip_nonfinite: inner must be"):
        amp.skip_nonfinite(lambda g: g)
    with pytest.raises(ValueError, match="mode must be 'cond', 'select' or None"):
        amp.skip_nonfinite(optax.sgd(0.1), mode="where")
    with pytest.raises(TypeError, match="check must be a callable"):
        amp.skip_nonfinite(optax.sgd(0.1), check=True)
    opt = amp.skip_nonfinite(optax.sgd(0.1))
    with pytest.raises(TypeError, match="called init first"):
        opt.update(jnp.ones(2), optax.sgd(0.1).init(jnp.ones(2)), jnp.ones(2))


# ------------------------------------------------------------------------------ plot
def test_plot_loss_scale(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    scales = [2.0**15, 2.0**14, 2.0**14, 2.0**15]
    ax = amp.plot_loss_scale(scales, [False, True, True, True])
    assert ax.get_yscale() == "log"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["loss scale", "skipped (1)"]
    ax.figure.savefig(tmp_path / "p.png", dpi=40)
    assert (tmp_path / "p.png").stat().st_size > 0
    with pytest.raises(ValueError, match="cannjax.amp.plot_loss_scale: .*equal length"):
        amp.plot_loss_scale([1.0, 2.0], [True])
    with pytest.raises(ValueError, match="must be > 0"):
        amp.plot_loss_scale([0.0], [True])


@pytest.mark.parametrize("scale", [3.0, 5.0, 2.0**15, 1e4])
def test_unscale_takes_the_reciprocal_in_the_gradients_dtype(scale):
    # A float32 reciprocal made StaticLossScale(3).unscale(float64 3.0) 1.00000003.
    ls = amp.StaticLossScale(scale)
    with jax.enable_x64(True):
        g = jnp.array([scale, 7.0 * scale, -scale / 3.0, 1e-300], jnp.float64)
        want = np.asarray(g) * (1.0 / scale)  # the float64 reciprocal
        got = np.asarray(ls.unscale(g))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_max_ulp(got, np.asarray(g) / scale, maxulp=1)
        assert float(ls.unscale(jnp.float64(scale))) == 1.0
        grads = amp.value_and_grad(lambda w: (w * g).sum(), ls)(jnp.ones(4)).grads
        np.testing.assert_array_max_ulp(np.asarray(grads), np.asarray(g), maxulp=1)
    g32 = jnp.array([scale, 7.0 * scale], jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(ls.unscale(g32)), np.asarray(g32) * np.float32(1 / np.float32(scale))
    )


def test_with_policy_as_a_decorator():
    seen = []

    @amp.with_policy(policy="p=f32,c=f16,o=f32")
    def matmul(w, x):
        seen.append(w.dtype)
        return x @ w

    y = matmul(jnp.ones((2, 2)), jnp.ones((1, 2)))
    assert matmul.__name__ == "matmul"
    assert y.dtype == jnp.float32 and seen == [jnp.float16]
    direct = amp.with_policy(lambda w, x: x @ w, policy="p=f32,c=f16,o=f32")
    np.testing.assert_array_equal(y, direct(jnp.ones((2, 2)), jnp.ones((1, 2))))
    with pytest.raises(TypeError, match="must be a policy string or a Policy"):
        amp.with_policy(policy=3)(lambda x: x)


# ---------------------------------------------------------------- issue 15: loss scales
@pytest.mark.parametrize("scale", [1.0, 0.25, 2.0**15, 2.0**24, 2.0**-10])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_unscale_is_exact_for_power_of_two_scales_in_the_gradient_dtype(scale, dtype):
    # unscale(g) is exactly g / S in the gradient's own (at least float32) dtype for
    # power-of-two scales. (Other scales are within one rounding: XLA:CPU's own division
    # is not IEEE-exact either, see LossScale.unscale.)
    with jax.enable_x64(dtype == "float64"):
        ls = amp.StaticLossScale(scale)
        g = rand.normal(jax.random.key(0), (4096,), jnp.float32) * 1e3
        g = g.astype(dtype)
        out = ls.unscale({"g": g})["g"]
        wide = np.float64 if dtype == "float64" else np.float32
        assert out.dtype == wide
        s = wide(np.float32(scale))  # the scale is held in float32
        np.testing.assert_array_equal(np.asarray(out), np.asarray(g).astype(wide) / s)


def test_finding_5_static_scale_of_three_unscales_float64_exactly():
    with jax.enable_x64(True):
        out = amp.StaticLossScale(3).unscale(jnp.float64(3.0))
        assert out.dtype == jnp.float64 and float(out) == 1.0


@pytest.mark.parametrize(
    "kwargs,arg,kind",
    [
        ({"min_loss_scale": jnp.array(1.0)}, "min_loss_scale", "float"),
        ({"max_loss_scale": jnp.float32(2.0**20)}, "max_loss_scale", "float"),
        ({"growth_factor": jnp.array(2.0)}, "growth_factor", "float"),
        ({"backoff_factor": jnp.array(0.5)}, "backoff_factor", "float"),
        ({"growth_interval": jnp.array(10)}, "growth_interval", "int"),
    ],
)
def test_static_hyperparameters_given_as_arrays_say_why_they_must_be_numbers(kwargs, arg, kind):
    with pytest.raises(
        TypeError,
        match=rf"cannjax\.amp\.DynamicLossScale: {arg} must be a Python {kind}, got a jax "
        rf"array .*static hyperparameter.*cannot be an array or a traced value",
    ):
        amp.DynamicLossScale(**kwargs)
