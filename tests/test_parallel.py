"""cannjax.parallel on one process with 8 CPU devices (conftest.py)."""

import dataclasses
import socket

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import cannjax
from cannjax import amp, parallel
from tests import _rng as rand

BUCKETS = [None, 64, 1024, parallel.DEFAULT_BUCKET_BYTES]


def mlp_params(key, sizes=(5, 16, 16, 3)):
    params = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        params.append({"w": rand.normal(k1, (a, b)) / np.sqrt(a),
                       "b": 0.1 * rand.normal(k2, (b,))})  # fmt: skip
    return params


def mlp_loss(params, batch):
    x, y = batch
    h = x
    for layer in params[:-1]:
        h = jnp.tanh(h @ layer["w"] + layer["b"][None])
    out = h @ params[-1]["w"] + params[-1]["b"][None]
    return jnp.mean((out - y) ** 2)


def make_batch(key, n=16):
    kx, ky = jax.random.split(key)
    return rand.normal(kx, (n, 5)), rand.normal(ky, (n, 3))


@pytest.fixture(scope="module")
def setup():
    return mlp_params(jax.random.key(0)), make_batch(jax.random.key(1))


def synced_grads(mesh, bucket_bytes, comm_dtype=None):
    def local(params, batch):
        params = jax.lax.pcast(params, "data", to="varying")
        g = jax.grad(mlp_loss)(params, batch)
        return parallel.all_reduce_mean(g, "data", bucket_bytes=bucket_bytes, comm_dtype=comm_dtype)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))


def test_eight_devices():
    assert len(jax.devices()) == 8


@pytest.mark.parametrize("bucket_bytes", BUCKETS)
def test_gradients_equal_full_batch_gradient(setup, bucket_bytes):
    params, batch = setup
    mesh = parallel.data_mesh()
    got = synced_grads(mesh, bucket_bytes)(params, batch)
    want = jax.jit(jax.grad(mlp_loss))(params, batch)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("bucket_bytes", [256])
def test_bfloat16_communication_error_within_documented_bound(setup, bucket_bytes):
    params, batch = setup
    mesh = parallel.data_mesh()
    got = synced_grads(mesh, bucket_bytes, jnp.bfloat16)(params, batch)
    want = jax.jit(jax.grad(mlp_loss))(params, batch)
    # Per-device gradients, for the bound 2u * mean_d |g_d| (u = 2**-8).
    xs, ys = (a.reshape(8, -1, a.shape[-1]) for a in batch)
    per_dev = jax.jit(jax.vmap(lambda x, y: jax.grad(mlp_loss)(params, (x, y))))(xs, ys)
    u = 2.0**-8
    worst = 0.0
    for g, w, d in zip(*(jax.tree.leaves(t) for t in (got, want, per_dev))):
        assert g.dtype == jnp.float32
        bound = 2 * u * jnp.mean(jnp.abs(d), axis=0) + 1e-6
        assert bool(jnp.all(jnp.abs(g - w) <= bound)), float(jnp.max(jnp.abs(g - w) - bound))
        worst = max(worst, float(jnp.max(jnp.abs(g - w))))
    assert worst > 0  # the rounding is really there (bfloat16 on the way)


@pytest.mark.parametrize("bucket_bytes", [None, 64])
def test_step_matches_single_device_training(setup, bucket_bytes):
    params, batch = setup
    opt = optax.adam(1e-2)
    step = parallel.data_parallel(mlp_loss, opt, bucket_bytes=bucket_bytes)
    p, s = params, opt.init(params)
    rp, rs = params, opt.init(params)

    @jax.jit
    def ref_step(p, s, batch):
        loss, g = jax.value_and_grad(mlp_loss)(p, batch)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    for i in range(3):
        b = make_batch(jax.random.key(10 + i))
        out = step(p, s, b)
        p, s = out.params, out.opt_state
        rp, rs, rloss = ref_step(rp, rs, b)
        np.testing.assert_allclose(out.metrics["loss"], rloss, rtol=1e-6)
        assert bool(out.metrics["grads_finite"])
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(rp)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert out.loss_scale is None


def _hlo_counts(bucket_bytes, comm_dtype=None):
    params, batch = mlp_params(jax.random.key(0)), make_batch(jax.random.key(1))
    opt = optax.sgd(0.1)
    step = parallel.data_parallel(mlp_loss, opt, bucket_bytes=bucket_bytes, comm_dtype=comm_dtype)
    return parallel.collective_counts(step.lower(params, opt.init(params), batch))


def test_bucketing_reduces_all_reduces_in_compiled_hlo():
    n_leaves = 6
    plain = _hlo_counts(None)["all-reduce"]
    bucketed = _hlo_counts(parallel.DEFAULT_BUCKET_BYTES)["all-reduce"]
    small = _hlo_counts(1024)["all-reduce"]
    # + 2 for the packed metrics pmean and the finite-flag pmin (separate reduce kinds).
    assert plain["buffers"] == n_leaves + 2
    assert bucketed["buffers"] == 1 + 2
    leaves = jax.tree.leaves(mlp_params(jax.random.key(0)))
    assert small["buffers"] == len(parallel.plan_buckets(leaves, 1024)) + 2
    assert bucketed["buffers"] < small["buffers"] < plain["buffers"]


def test_bfloat16_communication_uses_all_to_all_per_bucket():
    leaves = jax.tree.leaves(mlp_params(jax.random.key(0)))
    c = _hlo_counts(256, jnp.bfloat16)
    nb = len(parallel.plan_buckets(leaves, 256, jnp.bfloat16))
    assert nb > 1
    # A tiled all-to-all moves one piece per device: 8 buffers per bucket.
    assert c["all-to-all"]["buffers"] == 8 * nb
    assert c["all-gather"]["buffers"] == nb
    assert c["all-reduce"]["buffers"] == 2  # metrics and finite flag only


def test_lowered_program_communicates_in_bfloat16(setup):
    params, batch = setup
    opt = optax.sgd(0.1)
    step = parallel.data_parallel(mlp_loss, opt, comm_dtype=jnp.bfloat16)
    text = step.lower(params, opt.init(params), batch).as_text()
    lines = [ln for ln in text.splitlines() if "all_to_all" in ln or "all_gather" in ln]
    assert lines and all("bf16" in ln for ln in lines)


def test_plan_buckets_respects_capacity_and_dtype():
    leaves = [jax.ShapeDtypeStruct((s,), jnp.float32) for s in (4, 4, 4, 100, 4)]
    plan = parallel.plan_buckets(leaves, 40)
    assert sorted(i for b in plan for i in b) == list(range(5))
    for b in plan:
        assert len(b) == 1 or sum(leaves[i].shape[0] * 4 for i in b) <= 40
    assert plan == ((3,), (4, 2), (1, 0))  # 3 is too big to share; 4+2+1 exceed 40 bytes
    mixed = [jax.ShapeDtypeStruct((2,), d) for d in (jnp.float32, jnp.bfloat16, jnp.float32)]
    assert parallel.plan_buckets(mixed, 1024) == ((2,), (1,), (0,))
    assert parallel.plan_buckets(mixed, 1024, jnp.bfloat16) == ((2, 1, 0),)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HalvingScale:
    """A toy loss scale with the jmp/amp protocol: scale, unscale, adjust."""

    scale_value: jax.Array
    steps: jax.Array

    def scale(self, loss):
        return loss * self.scale_value

    def unscale(self, grads):
        return jax.tree.map(lambda g: g / self.scale_value, grads)

    def adjust(self, finite):
        return HalvingScale(
            jnp.where(finite, self.scale_value, self.scale_value / 2), self.steps + 1
        )


def test_loss_scale_hook_and_finite_flag_agree(setup):
    params, (x, y) = setup
    opt = optax.adam(1e-2)
    step = parallel.data_parallel(mlp_loss, opt)
    ls = HalvingScale(jnp.float32(2.0**10), jnp.int32(0))
    s0 = opt.init(params)
    good = step(params, s0, (x, y), ls)
    assert bool(good.metrics["grads_finite"]) and float(good.loss_scale.scale_value) == 1024
    ref = parallel.data_parallel(mlp_loss, opt)(params, s0, (x, y))
    for a, b in zip(jax.tree.leaves(good.params), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # One example on device 5 only overflows: every device must skip the update.
    bad_x = x.at[11, 0].set(jnp.inf)
    bad = step(params, s0, (bad_x, y), ls)
    assert not bool(bad.metrics["grads_finite"])
    assert float(bad.loss_scale.scale_value) == 512 and int(bad.loss_scale.steps) == 1
    for a, b in zip(jax.tree.leaves((bad.params, bad.opt_state)), jax.tree.leaves((params, s0))):
        np.testing.assert_array_equal(a, b)


def test_skip_nonfinite_without_loss_scale(setup):
    params, (x, y) = setup
    opt = optax.sgd(0.1)
    bad_x = x.at[0, 0].set(jnp.nan)
    skipping = parallel.data_parallel(mlp_loss, opt, skip_nonfinite=True)
    out = skipping(params, opt.init(params), (bad_x, y))
    for a, b in zip(jax.tree.leaves(out.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    applying = parallel.data_parallel(mlp_loss, opt)(params, opt.init(params), (bad_x, y))
    assert not all(bool(jnp.isfinite(a).all()) for a in jax.tree.leaves(applying.params))


# ---------------------------------------------------------------- saturation mode (Ascend)
F16_MAX = float(jnp.finfo(jnp.float16).max)  # 65504


def f16_loss(w, x):
    """Mean of x @ w computed in float16 on float32 master weights (amp's mixed policy)."""
    return jnp.mean(jnp.sum(x.astype(jnp.float16) * w.astype(jnp.float16)[None], axis=-1))


def saturating_batch(saturate):
    # 16 rows, 2 per device. With the default loss scale S = 2**15 the raw float16
    # gradient of w[0] on device 5 (rows 10 and 11) is S * (x[10, 0] + x[11, 0]) / 2;
    # rows of 2 - 2**-10 make it exactly 65504, float16's largest finite value, which is
    # what saturation-mode hardware leaves of an overflow. Every other raw gradient is
    # below 2**15 in magnitude.
    x = np.random.RandomState(0).uniform(-1, 1, (16, 3)).astype(np.float32)
    if saturate:
        x[10:12, 0] = 2 - 2.0**-10
    return jnp.asarray(x)


def local_raw_grads(x, scale=2.0**15):
    """Each device's raw (scaled, not averaged) gradient, one row per device."""

    def local(w, x):
        w = jax.lax.pcast(w, "data", to="varying")
        g = jax.grad(lambda w: scale * f16_loss(w, x).astype(jnp.float32))(w)
        return g[None]

    f = jax.shard_map(local, mesh=parallel.data_mesh(), in_specs=(P(), P("data")),
                      out_specs=P("data"))  # fmt: skip
    return np.asarray(jax.jit(f)(jnp.ones(3), x))


def assert_bit_identical(got, want):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        w = np.asarray(w)
        shards = [np.asarray(s.data) for s in g.addressable_shards]
        assert len(shards) == 8  # the replica on every device
        for shard in shards:
            assert shard.dtype == w.dtype and np.array_equal(shard, w)
            assert shard.tobytes() == w.tobytes()


def test_saturation_batch_saturates_one_device_only():
    raw = local_raw_grads(saturating_batch(True))
    assert np.all(np.isfinite(raw))
    assert np.argwhere(np.abs(raw) >= F16_MAX).tolist() == [[5, 0]] and raw[5, 0] == F16_MAX
    assert np.all(np.abs(local_raw_grads(saturating_batch(False))) < 2.0**15)


def _saturation_step(overflow_check, saturate, **kw):
    w = jnp.ones(3, jnp.float32)
    opt = optax.adam(1e-2)
    state = opt.init(w)
    ls = amp.DynamicLossScale()
    step = parallel.data_parallel(f16_loss, opt, overflow_check=overflow_check, **kw)
    return step(w, state, saturating_batch(saturate), ls), (w, state, ls)


@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_saturated_gradient_on_one_device_skips_the_step_everywhere(skip_nonfinite):
    out, (w, state, ls) = _saturation_step(amp.saturation_check(), True,
                                           skip_nonfinite=skip_nonfinite)  # fmt: skip
    assert not bool(out.metrics["grads_finite"])
    assert_bit_identical(out.params, w)
    assert_bit_identical(out.opt_state, state)
    # The loss scale backs off as DynamicLossScale.adjust does on an overflow: halved.
    want = ls.adjust(jnp.array(False))
    assert float(want.loss_scale) == 2.0**14
    assert_bit_identical(out.loss_scale, want)


def test_unsaturated_step_is_applied():
    out, (w, state, ls) = _saturation_step(amp.saturation_check(), False)
    assert bool(out.metrics["grads_finite"])
    assert not np.any(np.asarray(out.params) == np.asarray(w))
    assert int(out.opt_state[0].count) == 1
    assert float(out.loss_scale.loss_scale) == 2.0**15 and int(out.loss_scale.counter) == 1
    # The update is the full-batch adam step (unscaled gradients).
    opt = optax.adam(1e-2)
    g = jax.grad(lambda w: f16_loss(w, saturating_batch(False)).astype(jnp.float32))(w)
    u, _ = opt.update(g, state, w)
    np.testing.assert_allclose(out.params, optax.apply_updates(w, u), rtol=1e-6)


def test_isfinite_check_misses_the_saturated_gradient():
    # What the step did before it used amp's configured check: 65504 is finite, so an
    # IEEE check applies the step. The saturation check is what catches it.
    out, (w, _, _) = _saturation_step(amp.all_finite, True)
    assert bool(out.metrics["grads_finite"])
    assert not np.any(np.asarray(out.params) == np.asarray(w))


def test_default_overflow_check_follows_the_platform(monkeypatch):
    assert parallel.data_parallel(f16_loss, optax.sgd(0.1)).overflow_check is amp.all_finite
    # Pretend JAX's default backend is Ascend: the configured default (saturation
    # detection) is picked up when the step is built, with no overflow_check given.
    ascend = cannjax.backend.ascend.config().platform
    monkeypatch.setattr(jax, "default_backend", lambda: ascend)
    out, (w, state, ls) = _saturation_step(None, True)
    assert not bool(out.metrics["grads_finite"])
    assert_bit_identical((out.params, out.opt_state), (w, state))
    assert float(out.loss_scale.loss_scale) == 2.0**14


def test_bad_overflow_check():
    with pytest.raises(TypeError, match=r"data_parallel: overflow_check must be a callable"):
        parallel.data_parallel(mlp_loss, optax.sgd(0.1), overflow_check="saturation")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_params_without_loss_scale_keep_their_gradient_dtype(setup, dtype):
    params, batch = setup
    params = jax.tree.map(lambda p: p.astype(dtype), params)
    seen = []

    def record(updates, state, params=None):
        seen.extend(jnp.result_type(u) for u in jax.tree.leaves(updates))
        return updates, state

    opt = optax.chain(optax.GradientTransformation(lambda p: optax.EmptyState(), record),
                      optax.sgd(0.1))  # fmt: skip
    step = parallel.data_parallel(mlp_loss, opt, bucket_bytes=None)
    out = step(params, opt.init(params), batch)
    assert seen and all(d == dtype for d in seen)  # the optimizer sees jax.grad's dtype
    assert all(p.dtype == dtype for p in jax.tree.leaves(out.params))
    g = jax.grad(mlp_loss)(params, batch)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, params, g)
    for a, b in zip(jax.tree.leaves(out.params), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=2e-2, atol=2e-2)
    # On the wire: bfloat16 stays bfloat16; float16 is summed in float32.
    text = step.lower(params, opt.init(params), batch).as_text()
    # The one 16x16 weight: its all_reduce's type closes the region, "}) : (tensor<..>) ->".
    reduces = [ln for ln in text.splitlines() if "}) : (tensor<16x16x" in ln]
    wire = "bf16" if dtype == jnp.bfloat16 else "f32"
    assert len(reduces) == 1 and f"(tensor<16x16x{wire}>)" in reduces[0], reduces


def test_aux_metrics_are_averaged(setup):
    params, batch = setup

    def loss_aux(p, b):
        loss = mlp_loss(p, b)
        return loss, {"mean_x": jnp.mean(b[0]), "twice": 2 * loss}

    opt = optax.sgd(0.1)
    out = parallel.data_parallel(loss_aux, opt, has_aux=True)(params, opt.init(params), batch)
    np.testing.assert_allclose(out.metrics["mean_x"], jnp.mean(batch[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.metrics["twice"], 2 * out.metrics["loss"], rtol=1e-6)
    g = jax.grad(mlp_loss)(params, batch)
    np.testing.assert_allclose(out.metrics["grad_norm"], optax.tree.norm(g), rtol=1e-5)
    vec = parallel.data_parallel(lambda p, b: (mlp_loss(p, b), {"v": b[0][:, 0]}), opt,
                                 has_aux=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"aux\['v'\] has shape \(2,\); has_aux metrics must"):
        vec(params, opt.init(params), batch)


def test_submesh_and_other_axis_name(setup):
    params, batch = setup
    mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    opt = optax.sgd(0.1)
    step = parallel.data_parallel(mlp_loss, opt, mesh=mesh, axis_name="dp", donate=True)
    p = jax.tree.map(jnp.copy, params)
    out = step(p, opt.init(p), batch)
    np.testing.assert_allclose(out.metrics["loss"], mlp_loss(params, batch), rtol=1e-6)
    assert all(x.is_deleted() for x in jax.tree.leaves(p))  # donated


def test_shard_batch_and_replicate():
    mesh = parallel.data_mesh()
    x = parallel.shard_batch({"x": np.arange(16.0).reshape(16, 1)}, mesh)["x"]
    assert x.sharding.spec == P("data") and len(x.addressable_shards) == 8
    np.testing.assert_array_equal(x, np.arange(16.0).reshape(16, 1))
    r = parallel.replicate(jnp.ones(3), mesh)
    assert r.sharding.is_fully_replicated


# ---------------------------------------------------------------- bad input
def test_batch_not_divisible(setup):
    params, (x, y) = setup
    opt = optax.sgd(0.1)
    step = parallel.data_parallel(mlp_loss, opt)
    with pytest.raises(ValueError, match=r"data_parallel: batch size 10 is not divisible by the 8"):
        step(params, opt.init(params), (x[:10], y[:10]))
    with pytest.raises(ValueError, match=r"shard_batch: .* 10 examples, not divisible"):
        parallel.shard_batch(x[:10], parallel.data_mesh())


def test_missing_axis_name(setup):
    with pytest.raises(ValueError, match=r"data_parallel: axis_name 'batch' is not an axis"):
        parallel.data_parallel(
            mlp_loss, optax.sgd(0.1), mesh=parallel.data_mesh("data"), axis_name="batch"
        )
    with pytest.raises(ValueError, match=r"all_reduce_mean: axis name 'data' is not bound"):
        parallel.all_reduce_mean({"g": jnp.ones(3)}, "data")
    with pytest.raises(ValueError, match=r"shard_batch: axis_name 'x' is not an axis"):
        parallel.shard_batch(jnp.ones(8), parallel.data_mesh(), "x")


def test_mismatched_pytrees(setup):
    params, (x, y) = setup
    opt = optax.adam(1e-2)
    step = parallel.data_parallel(mlp_loss, opt)
    with pytest.raises(ValueError, match=r"opt_state does not match optimizer.init\(params\)"):
        step(params, opt.init(params[:2]), (x, y))
    with pytest.raises(ValueError, match=r"different leading \(batch\) sizes"):
        step(params, opt.init(params), (x, y[:8]))


def test_already_reduced_gradients_are_refused(setup):
    params, batch = setup

    def local(params, batch):
        g = jax.grad(mlp_loss)(params, batch)  # invariant params: jax sums the grads
        return parallel.all_reduce_mean(g, "data")

    f = jax.shard_map(local, mesh=parallel.data_mesh(), in_specs=(P(), P("data")), out_specs=P())
    with pytest.raises(ValueError, match=r"\[0\]\['b'\] is already invariant over 'data'"):
        f(params, batch)


def test_bad_options():
    opt = optax.sgd(0.1)
    with pytest.raises(ValueError, match=r"bucket_bytes must be an int >= 0"):
        parallel.data_parallel(mlp_loss, opt, bucket_bytes=-1)
    with pytest.raises(
        ValueError, match=r"comm_dtype must be None .* or jnp.bfloat16, got float16"
    ):
        parallel.data_parallel(mlp_loss, opt, comm_dtype=jnp.float16)
    with pytest.raises(TypeError, match=r"optimizer must be an optax.GradientTransformation"):
        parallel.data_parallel(mlp_loss, "adam")
    with pytest.raises(TypeError, match=r"loss_fn must be callable"):
        parallel.data_parallel(None, opt)
    with pytest.raises(TypeError, match=r"only floating gradients"):
        f = jax.shard_map(lambda g: parallel.all_reduce_mean(g, "data"),
                          mesh=parallel.data_mesh(), in_specs=P("data"), out_specs=P())  # fmt: skip
        f(jnp.arange(8))


def test_loss_scale_without_protocol(setup):
    params, batch = setup
    opt = optax.sgd(0.1)
    with pytest.raises(TypeError, match=r"loss_scale must provide scale.*ArrayImpl lacks"):
        parallel.data_parallel(mlp_loss, opt)(params, opt.init(params), batch, jnp.float32(1))


@pytest.mark.parametrize(
    "args,match",
    [
        (("localhost", 2, 0), "coordinator_address must be 'host:port'"),
        (("127.0.0.1:99999", 2, 0), "coordinator_address must be 'host:port'"),
        (("127.0.0.1:1234", 2, 2), r"process_id must be an int in \[0, 2\)"),
        (("127.0.0.1:1234", 0, 0), "num_processes must be an int >= 1"),
    ],
)
def test_initialize_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        parallel.initialize(*args)


def test_initialize_unreachable_coordinator_times_out():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    import time

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"coordinator at 127.0.0.1:{port} did not accept"):
        parallel.initialize(f"127.0.0.1:{port}", 2, 1, init_timeout_s=1)
    assert time.monotonic() - t0 < 5
    assert not jax.distributed.is_initialized()


def test_public_namespace():
    assert cannjax.parallel.data_parallel is parallel.data_parallel


def test_data_parallel_as_a_decorator():
    opt = optax.sgd(0.1)

    @parallel.data_parallel(optimizer=opt)
    def step(w, batch):
        x, y = batch
        return jnp.mean((x @ w - y) ** 2)

    direct = parallel.data_parallel(lambda w, b: jnp.mean((b[0] @ w - b[1]) ** 2), opt)
    assert isinstance(step, parallel.DataParallelStep)
    w = jnp.zeros(3)
    batch = (jnp.ones((8, 3)), jnp.ones(8))
    a, b = step(w, opt.init(w), batch), direct(w, opt.init(w), batch)
    np.testing.assert_array_equal(a.params, b.params)
    assert float(a.metrics["loss"]) == 1.0
