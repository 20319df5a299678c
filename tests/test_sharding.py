"""FSDP and tensor-parallel shardings (cannjax.parallel.param_shardings and its two
faces), the per-step collective bytes of a compiled program, and what cannjax's
operators do under them, on the 8 CPU devices of conftest.py."""

import functools

import equinox as eqx
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cannjax
from cannjax import parallel
from cannjax.models import (
    GPTConfig,
    gpt_logits,
    gpt_loss,
    init_gpt,
    plain_gpt_logits,
    plain_gpt_loss,
)
from tests import _rng as rand

CFG = GPTConfig(vocab=64, width=32, heads=4, layers=2, seq_len=16)


@pytest.fixture(scope="module")
def gpt():
    params = init_gpt(jax.random.key(0), CFG)
    tokens = rand.randint(jax.random.key(1), (8, CFG.seq_len), 0, CFG.vocab)
    return params, tokens


def _specs(shardings):
    return {
        jax.tree_util.keystr(k, simple=True, separator="/"): s.spec
        for k, s in jax.tree_util.tree_leaves_with_path(shardings)
    }


# ------------------------------------------------------------------- the rules
def test_fsdp_shards_the_largest_dimension_the_axis_divides(gpt):
    mesh = parallel.model_mesh(4, 2)
    specs = _specs(parallel.fsdp(gpt[0], mesh))
    assert specs["blocks/w_qkv"] == P(None, None, "data")  # [L, D, 3D]: 3D is largest
    assert specs["blocks/w_2"] == P(None, "data")  # [L, 4D, D]
    assert specs["embed"] == P("data")  # [V, D]
    assert specs["lnf_scale"] == P("data")  # [D]
    assert specs["blocks/ln1_scale"] == P(None, "data")  # [L, D]: D, not L = 2


def test_tensor_parallel_is_column_parallel_unless_a_rule_says_otherwise(gpt):
    mesh = parallel.model_mesh(4, 2)
    rules = [(r"w_o$|w_2$", P(None, "model"))]  # row-parallel: the input features
    specs = _specs(parallel.tensor_parallel(gpt[0], mesh, rules=rules))
    assert specs["blocks/w_qkv"] == P(None, None, "model")
    assert specs["blocks/w_1"] == P(None, None, "model")
    assert specs["blocks/w_o"] == specs["blocks/w_2"] == P(None, "model")
    assert specs["lnf_bias"] == P()  # 1-d: replicated


def test_fsdp_and_tensor_parallel_together(gpt):
    mesh = parallel.model_mesh(4, 2)
    specs = _specs(parallel.param_shardings(gpt[0], mesh, fsdp="data", tensor="model"))
    assert specs["blocks/w_qkv"] == P(None, "data", "model")  # FSDP: the largest free dim
    assert specs["head"] == P("data", "model")
    assert specs["lnf_scale"] == P("data")


def test_flax_nnx_state_equinox_module_and_dict():
    mesh = parallel.model_mesh(4, 2)
    model = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    s = parallel.param_shardings(state, mesh, fsdp="data", tensor="model")
    assert s["kernel"].get_value().spec == P("data", "model")
    assert s["bias"].get_value().spec == P("data")
    placed = jax.device_put(state, s)
    assert placed["kernel"].get_value().sharding.spec == P("data", "model")

    mlp = eqx.nn.MLP(8, 4, 16, 1, key=jax.random.key(0))
    s = parallel.fsdp(mlp, mesh)
    assert s.layers[0].weight.spec == P("data")  # [16, 8]
    assert s.activation is None  # not an array: as equinox.filter_shard expects
    sharded = eqx.filter_shard(mlp, s)
    assert sharded.layers[0].weight.sharding.spec == P("data")

    s = parallel.tensor_parallel({"w": jnp.zeros((8, 6)), "b": jnp.zeros(6)}, mesh)
    assert s["w"].spec == P(None, "model") and s["b"].spec == P()


@pytest.mark.parametrize(
    "data,model,kw",
    [  # make test: TP and FSDP + TP; FSDP alone with make test-extended
        pytest.param(4, 2, dict(fsdp="data"), marks=pytest.mark.extended),
        pytest.param(8, 1, dict(fsdp="data"), marks=pytest.mark.extended),
        (1, 8, dict(tensor="model")),
        (4, 2, dict(fsdp="data", tensor="model")),
    ],  # fmt: skip
    ids=["fsdp-4x2", "fsdp-8x1", "tp-1x8", "both-4x2"],
)
@pytest.mark.parametrize(
    # plain JAX's partitioning is JAX's to test: with `make test-extended` only.
    "loss",
    [pytest.param(plain_gpt_loss, marks=pytest.mark.extended), gpt_loss],
    ids=["plain", "cannjax"],
)
def test_sharded_step_gives_the_single_device_gradients(gpt, data, model, kw, loss):
    params, tokens = gpt
    mesh = parallel.model_mesh(data, model)
    shardings = parallel.param_shardings(params, mesh, **kw)
    batch = NamedSharding(mesh, P("data"))

    def step(p, t):
        return jax.value_and_grad(loss)(p, t, t, CFG)

    want = jax.jit(step)(params, tokens)
    got = jax.jit(step, in_shardings=(shardings, batch))(params, tokens)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    gathered = jax.tree.leaves(got[1])
    assert any(not x.sharding.is_fully_replicated for x in gathered)  # really sharded


# ------------------------------------------------------------------- bad input
def test_bad_input_names_the_function_the_parameter_and_the_shapes(gpt):
    params = gpt[0]
    mesh = parallel.model_mesh(4, 2)
    fn = r"cannjax\.parallel\.tensor_parallel: "
    with pytest.raises(ValueError, match=fn + r"rule 'w_1' gives parameter blocks/w_1 \(shape "
                       r"\(2, 32, 128\)\) the spec .*; dimension 0 \(size 2\) is not divisible "
                       r"by the 4 devices of data"):  # fmt: skip
        parallel.tensor_parallel(params, mesh, rules=[("w_1", P("data"))])
    with pytest.raises(ValueError, match=fn + r".*'expert' is not a mesh axis"):
        parallel.tensor_parallel(params, mesh, rules=[("head", P(None, "expert"))])
    with pytest.raises(ValueError, match=fn + r".*lnf_bias.*more entries than the parameter"):
        parallel.tensor_parallel(params, mesh, rules=[("lnf_bias", P(None, "model"))])
    with pytest.raises(ValueError, match=r"cannjax\.parallel\.fsdp: axis_name 'dp' is not an axis"):
        parallel.fsdp(params, mesh, axis="dp")
    with pytest.raises(ValueError, match=r"param_shardings: give fsdp=AXIS, tensor=AXIS or both"):
        parallel.param_shardings(params, mesh)
    with pytest.raises(TypeError, match=fn + r"each rule must be a \(str pattern, PartitionSpec\)"):
        parallel.tensor_parallel(params, mesh, rules=[(r"w", "model")])
    with pytest.raises(TypeError, match=fn + r"rules must be a sequence"):
        parallel.tensor_parallel(params, mesh, rules="w_o")
    with pytest.raises(ValueError, match=fn + r"rule pattern '\(' is not a regular expression"):
        parallel.tensor_parallel(params, mesh, rules=[("(", P())])
    with pytest.raises(TypeError, match=r"cannjax\.parallel\.fsdp: mesh must be a jax\.sharding"):
        parallel.fsdp(params, "mesh")
    with pytest.raises(ValueError, match=r"model_mesh: data \* model = 4 \* 4 = 16 must equal"):
        parallel.model_mesh(4, 4)
    with pytest.raises(ValueError, match=r"model_mesh: model must be an int >= 1, got 0"):
        parallel.model_mesh(8, 0)


# ------------------------------------------------------------- collective bytes
def test_collective_bytes_weigh_a_loop_by_its_trip_count():
    mesh = parallel.data_mesh()

    def f(x, n):
        return jax.lax.fori_loop(0, n, lambda i, a: jax.lax.psum(a, "data"), x)

    def compiled(n):
        g = jax.shard_map(lambda x: f(x, n), mesh=mesh, in_specs=P(), out_specs=P())
        return jax.jit(g).lower(jnp.ones(16)).compile()

    one, five = parallel.collective_bytes(compiled(1)), parallel.collective_bytes(compiled(5))
    assert one["all-reduce"] == 64 and five["all-reduce"] == 5 * 64 == five["total"]
    # collective_counts sees the instruction once, whatever the trip count.
    assert parallel.collective_counts(compiled(5))["all-reduce"]["ops"] == 1


def test_collective_bytes_count_an_all_gather_by_its_gathered_array():
    mesh = parallel.data_mesh()
    g = jax.shard_map(
        lambda x: jax.lax.all_gather(x, "data", tiled=True), mesh=mesh,
        in_specs=P("data"), out_specs=P(), check_vma=False,
    )  # fmt: skip
    got = parallel.collective_bytes(jax.jit(g).lower(jnp.ones(64, jnp.float32)))
    assert got["all-gather"] == 64 * 4 and got["total"] == 256


def test_collective_bytes_of_hlo_without_entry_is_an_error():
    with pytest.raises(ValueError, match=r"collective_bytes: no ENTRY computation"):
        parallel.collective_bytes("HloModule m\n")


# --------------------------------------------------- vocabulary-parallel loss
@pytest.mark.parametrize(
    "kw",
    [{}, {"label_smoothing": 0.1, "z_loss": 1e-4, "logit_cap": 30.0}, {"reduction": "mean"}],
    ids=["plain", "variants", "mean"],
)
def test_linear_cross_entropy_with_its_head_sharded_over_the_vocabulary(kw):
    # Megatron-LM's vocabulary-parallel cross-entropy: per-row statistics are reduced
    # over the devices, never the [D, V] head or the [N, V] logits gathered.
    N, D, V = 512, 64, 8192
    mesh = parallel.model_mesh(1, 8)
    args = (
        jax.ShapeDtypeStruct((N, D), jnp.float32),
        jax.ShapeDtypeStruct((D, V), jnp.float32),
        jax.ShapeDtypeStruct((N,), jnp.int32),
    )

    def loss(x, w, y):
        out = cannjax.ops.linear_cross_entropy(x, w, y, **kw)
        return out if out.ndim == 0 else out.mean()

    def compiled(head):
        rep = NamedSharding(mesh, P())
        f = jax.jit(jax.value_and_grad(loss, (0, 1)), in_shardings=(rep, head, rep))
        return f.lower(*args).compile()

    sharded = compiled(NamedSharding(mesh, P(None, "model")))
    whole = compiled(NamedSharding(mesh, P()))
    assert "all-gather" not in sharded.as_text()
    moved = parallel.collective_bytes(sharded)
    # dx = G w^T summed over the vocabulary shards, and the per-row statistics: no more.
    assert moved["total"] <= 4 * N * D + 64 * N * 4, moved
    temp = sharded.memory_analysis().temp_size_in_bytes
    assert temp <= whole.memory_analysis().temp_size_in_bytes / 4


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize(
    "head, gathered, summed",
    [
        (P(), 0, lambda N, D, V: 4 * D * V),  # dw over the data shards
        (P(None, "model"), 0, lambda N, D, V: 4 * D * V // 2 + 4 * N * D // 4),  # and dx
        (P(None, "data"), 1, lambda N, D, V: 4 * D * V),  # FSDP: the head gathered
    ],
    ids=["replicated", "vocab-parallel", "fsdp"],
)
def test_linear_cross_entropy_keeps_data_parallel_rows_local(head, gathered, summed, reduction):
    # Rows sharded over data: forward and backward run on each device's own rows
    # (core/partitioned.py) and the weight gradient is summed once after the loop, as
    # plain JAX sums it. Before, the partitioner gathered the rows into the loop and
    # every device computed every row (replicated head, mean: 133,120 bytes gathered and
    # 4x the work; now nothing gathered and dw's 1,048,576 bytes summed). Beyond the
    # bound: per-row statistics and scalars.
    N, D, V = 512, 64, 4096
    mesh = parallel.model_mesh(4, 2)
    rows, lab = NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P("data"))
    x = rand.normal(jax.random.key(0), (N, D))
    w = 0.1 * rand.normal(jax.random.key(1), (D, V))
    y = rand.randint(jax.random.key(2), (N,), 0, V).at[::5].set(-100)

    def loss(x, w, y):
        out = cannjax.ops.linear_cross_entropy(x, w, y, chunk_size=64, reduction=reduction,
                                               label_smoothing=0.1, z_loss=1e-4)  # fmt: skip
        return out if out.ndim == 0 else jnp.sum(jnp.sin(out))

    step = jax.value_and_grad(loss, (0, 1))
    f = jax.jit(step, in_shardings=(rows, NamedSharding(mesh, head), lab))
    compiled = f.lower(x, w, y).compile()
    moved = parallel.collective_bytes(compiled)
    assert moved["all-gather"] == gathered * 4 * D * V, moved  # never the rows
    assert moved["all-reduce"] + moved["reduce-scatter"] <= summed(N, D, V) + 16 * N * 4, moved
    for got, want in zip(jax.tree.leaves(f(x, w, y)), jax.tree.leaves(step(x, w, y))):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("head", [P(), P(None, "model")], ids=["replicated", "vocab-parallel"])
def test_linear_jensen_shannon_keeps_data_parallel_rows_local(head, reduction):
    # The fused distillation loss as linear_cross_entropy: the student's and the
    # teacher's rows stay on their devices; with the heads split over the vocabulary the
    # per-row log-sum-exps and divergences are summed over the model axis.
    N, D, Dt, V = 256, 32, 48, 1024
    mesh = parallel.model_mesh(4, 2)
    keys = jax.random.split(jax.random.key(0), 5)
    x, tx = rand.normal(keys[0], (N, D)), rand.normal(keys[1], (N, Dt))
    w = 0.3 * rand.normal(keys[2], (D, V))
    tw = 0.3 * rand.normal(keys[3], (Dt, V))
    y = rand.randint(keys[4], (N,), 0, V).at[::7].set(-100)

    def loss(x, w, tx, tw, y):
        out = cannjax.ops.linear_jensen_shannon(x, w, tx, tw, y, beta=0.3, temperature=2.0,
                                                reduction=reduction, chunk_size=32)  # fmt: skip
        return out if out.ndim == 0 else jnp.sum(jnp.sin(out))

    step = jax.value_and_grad(loss, (0, 1))
    rows, heads = NamedSharding(mesh, P("data")), NamedSharding(mesh, head)
    f = jax.jit(step, in_shardings=(rows, heads, rows, heads, rows))
    compiled = f.lower(x, w, tx, tw, y).compile()
    moved = parallel.collective_bytes(compiled)
    assert moved["all-gather"] == 0, moved
    # dw over the data shards (half of it per device when split), dx over model, rows' sums.
    assert moved["total"] <= 4 * D * V + 4 * N * D + 16 * N * 4, moved
    for got, want in zip(
        jax.tree.leaves(f(x, w, tx, tw, y)), jax.tree.leaves(step(x, w, tx, tw, y))
    ):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_export_against_an_abstract_mesh_refuses_only_the_fused_losses_and_attention():
    # Lowering against an AbstractMesh (no devices) works for the operators; the fused
    # losses and attention ask for the devices their partitioning needs (all three
    # partition themselves: core/partitioned.py), and JAX refuses that there.
    mesh = jax.sharding.AbstractMesh((4, 2), ("data", "model"),
                                     axis_types=(jax.sharding.AxisType.Explicit,) * 2)  # fmt: skip
    rows = NamedSharding(mesh, P("data"))
    x = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=rows)
    w = jax.ShapeDtypeStruct((4, 16), jnp.float32, sharding=NamedSharding(mesh, P()))
    y = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=rows)
    exported = jax.export.export(jax.jit(jax.grad(lambda x: cannjax.ops.gelu(x).sum())),
                                 platforms=["cpu"])(x)  # fmt: skip
    assert exported.in_shardings_jax(mesh)[0].spec == P("data")
    with pytest.raises(ValueError, match="require devices"):
        jax.export.export(jax.jit(cannjax.ops.linear_cross_entropy), platforms=["cpu"])(x, w, y)
    auto = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
    qkv = jax.ShapeDtypeStruct((8, 16, 2, 4), jnp.float32, sharding=NamedSharding(auto, P("data")))
    with pytest.raises(ValueError, match="require devices"):
        jax.export.export(jax.jit(cannjax.ops.attention), platforms=["cpu"])(qkv, qkv, qkv)


def test_linear_cross_entropy_rows_local_under_transforms():
    # vmap, second derivatives: the row-local loop falls back to the loop as written.
    mesh = parallel.model_mesh(4, 2)
    x = rand.normal(jax.random.key(0), (3, 32, 8))
    w = 0.1 * rand.normal(jax.random.key(1), (8, 64))
    y = rand.randint(jax.random.key(2), (3, 32), 0, 64)

    def loss(x, w, y):
        return cannjax.ops.linear_cross_entropy(x, w, y, reduction="mean", chunk_size=8)

    batched = jax.vmap(jax.grad(loss, (0, 1)), in_axes=(0, None, 0))
    s = NamedSharding(mesh, P(None, "data"))
    got = jax.jit(batched, in_shardings=(s, NamedSharding(mesh, P(None, "model")), s))(x, w, y)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(batched(x, w, y))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    hess = jax.hessian(lambda w: loss(x[0], w, y[0]))
    sharded = jax.jit(hess, in_shardings=NamedSharding(mesh, P(None, "model")))(w)
    np.testing.assert_allclose(sharded, hess(w), rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------ attention by heads
@pytest.mark.parametrize(
    "kw", [{"causal": True}, {"causal": True, "window": (16, 0), "logit_cap": 30.0}]
)
def test_attention_with_heads_sharded_over_the_model_axis_stays_local(kw):
    # Batch over data, query and key/value heads over model (8 query heads reading 4
    # key/value heads: each device's query heads read its own key/value heads).
    mesh = parallel.model_mesh(2, 4)
    s = NamedSharding(mesh, P("data", None, "model"))
    q = jax.ShapeDtypeStruct((4, 64, 8, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((4, 64, 4, 16), jnp.float32)

    def loss(q, k, v):
        return jnp.sum(jnp.sin(cannjax.ops.attention(q, k, v, **kw)))

    step = jax.jit(jax.grad(loss, (0, 1, 2)), in_shardings=(s, s, s), out_shardings=(s, s, s))
    assert parallel.collective_bytes(step.lower(q, kv, kv))["total"] == 0


def test_attention_with_its_head_dim_split_moves_that_axis_to_the_batch():
    # Heads over data (4), each head's features H over model (2): the logits q k^T are
    # partial sums over model. Plain autodiff all-reduces them in the forward and dp in
    # the backward. The kernel partitions itself (core/partitioned.HeadsLayout): model
    # moves to the batch (an all-to-all of the operands) and each device runs its own
    # sequences' heads. 395,264 bytes and 447,696 of temp here against plain's 1,048,576
    # and 2,097,152 (with q and k gathered over H before the kernel, as before: 526,336
    # and 905,616).
    mesh = parallel.model_mesh(4, 2)
    s = NamedSharding(mesh, P(None, None, "data", "model"))
    x = jax.ShapeDtypeStruct((2, 256, 4, 32), jnp.float32)

    def compiled(attention):
        def loss(q, k, v):
            return jnp.sum(jnp.sin(attention(q, k, v)))

        step = jax.jit(jax.grad(loss, (0, 1, 2)), in_shardings=(s, s, s), out_shardings=(s, s, s))
        c = step.lower(x, x, x).compile()
        return parallel.collective_bytes(c)["total"], c.memory_analysis().temp_size_in_bytes

    plain = compiled(functools.partial(jax.nn.dot_product_attention, is_causal=True))
    ours = compiled(functools.partial(cannjax.ops.attention, causal=True))
    assert plain[0] > 0
    assert ours[0] <= 0.5 * plain[0], (ours, plain)
    assert ours[1] <= 0.3 * plain[1], (ours, plain)


def test_attention_on_operands_every_device_holds_splits_them_over_the_devices():
    # q, k, v whole on each of 8 devices (as a projection that merges heads and
    # features leaves them when 4 heads' features are split 8 ways): each device runs
    # the kernel on its share of the batch, and the gradients are gathered. Before, every
    # device ran the whole kernel: the temp of one device's step.
    mesh = parallel.model_mesh(1, 8)
    whole = NamedSharding(mesh, P())
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (rand.normal(key, (8, 256, 4, 32)) for key in ks)

    def loss(q, k, v):
        return jnp.sum(jnp.sin(cannjax.ops.attention(q, k, v, causal=True)))

    grad = jax.grad(loss, (0, 1, 2))
    sharded = jax.jit(grad, in_shardings=(whole,) * 3, out_shardings=(whole,) * 3)
    compiled = sharded.lower(q, k, v).compile()
    one = jax.jit(grad).lower(q, k, v).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= 0.2 * one.memory_analysis().temp_size_in_bytes
    for got, want in zip(compiled(q, k, v), jax.jit(grad)(q, k, v)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("bias_shape", [(1, 4, 64, 64), (4, 1, 64, 64), (4, 4, 64, 64)])
def test_attention_bias_gradient_is_summed_over_the_devices_it_is_broadcast_over(bias_shape):
    # Batch over data, heads over model: a bias broadcast over the batch (ALiBi-like) or
    # the heads has its gradient summed over the devices that split them.
    mesh = parallel.model_mesh(2, 4)
    s = NamedSharding(mesh, P("data", None, "model"))
    ks = jax.random.split(jax.random.key(1), 4)
    q, k, v = (rand.normal(key, (4, 64, 4, 16)) for key in ks[:3])
    bias = rand.normal(ks[3], bias_shape)

    def loss(q, k, v, bias):
        out = cannjax.ops.attention(q, k, v, bias=bias, causal=True, block_q=16, block_k=16)
        return jnp.sum(jnp.sin(out))

    grad = jax.grad(loss, (0, 1, 2, 3))
    b = NamedSharding(mesh, P())
    got = jax.jit(grad, in_shardings=(s, s, s, b))(q, k, v, bias)
    for g, want in zip(got, jax.jit(grad)(q, k, v, bias)):
        np.testing.assert_allclose(g, want, rtol=2e-5, atol=2e-6)


def test_attention_partitioned_under_transforms():
    # vmap and forward-over-reverse in a sharded program: the kernel falls back to the
    # kernel as written (row_local's batching and JVP rules), values equal one device's.
    mesh = parallel.model_mesh(2, 4)
    ks = jax.random.split(jax.random.key(2), 3)
    q, k, v = (rand.normal(key, (3, 2, 32, 4, 8)) for key in ks)

    def loss(q, k, v):
        return jnp.sum(jnp.sin(cannjax.ops.attention(q, k, v, causal=True, block_q=8)))

    s = NamedSharding(mesh, P(None, "data", None, "model"))
    batched = jax.vmap(jax.grad(loss, (0, 1, 2)))
    got = jax.jit(batched, in_shardings=(s, s, s))(q, k, v)
    for a, b in zip(got, batched(q, k, v)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)

    def hvp(q):
        return jax.jvp(jax.grad(lambda q: loss(q, k[0], v[0])), (q,), (jnp.ones_like(q),))[1]

    sharded = jax.jit(hvp, in_shardings=NamedSharding(mesh, P("data", None, "model")))(q[0])
    np.testing.assert_allclose(sharded, hvp(q[0]), rtol=2e-4, atol=2e-5)


# ------------------------------------------------------- linear's weight gradient
SMALL = GPTConfig(vocab=256, width=64, heads=4, layers=2, seq_len=64)


def _gradient_bytes(loss, data, model, **rules):
    """Collective bytes of ``jit(grad(loss))`` for the small GPT, batch 16 sharded over
    data, parameters by ``param_shardings(**rules)`` (compiled, not run)."""
    params = jax.eval_shape(lambda: init_gpt(jax.random.key(0), SMALL))
    tokens = jax.ShapeDtypeStruct((16, SMALL.seq_len), jnp.int32)
    mesh = parallel.model_mesh(data, model)
    shardings = (parallel.param_shardings(params, mesh, **rules),
                 NamedSharding(mesh, P("data")))  # fmt: skip
    step = jax.jit(jax.grad(loss), in_shardings=shardings)
    return parallel.collective_bytes(step.lower(params, tokens))["total"]


def test_gpt_layers_under_fsdp_move_no_more_bytes_than_plain():
    # FSDP: the batch and each weight's larger dimension share the data axis, and the
    # partitioner gathers activations, for plain autodiff too. The down projection's dx
    # and dw both read its output cotangent g; a weight gradient that copied g
    # transposed gave the partitioner a second layout of g to gather: 4,708,608 bytes
    # here against plain's 4,184,320. (The loss is on the logits, not
    # linear_cross_entropy, whose row chunks the partitioner gathers under FSDP.)
    def moved(logits):
        return _gradient_bytes(lambda p, t: jnp.mean(logits(p, t, SMALL) ** 2), 4, 2, fsdp="data")

    # The norms' recomputation gathers their sharded scale and bias again in the
    # backward (models/recompute.py), 2,048 bytes here, which the layer loop's placed
    # carry (next test) more than pays for.
    plain = moved(plain_gpt_logits)
    assert plain > 0
    assert moved(gpt_logits) <= plain


@pytest.mark.parametrize(
    "data, model, rules",
    [
        (4, 2, {"fsdp": "data"}),
        (4, 2, {"fsdp": "data", "tensor": "model"}),
        (1, 8, {"tensor": "model"}),  # 4 heads over 8 devices: each head's H split in two
    ],
    ids=["fsdp", "fsdp+tp", "tp"],
)
def test_gpt_step_moves_no_more_bytes_than_plain(data, model, rules):
    # The whole step, loss included: linear_cross_entropy's loops run on each device's
    # rows (before: FSDP 4,618,500 bytes against plain's 4,184,320, FSDP + TP 6,062,724
    # against 4,961,920), and an elementwise backward keeps its cotangent sharded as its
    # input (unary.py; it was gathered over the model axis under FSDP + TP). The mean
    # counts every token (ignore_index=None), so it reduces no count across devices (4
    # bytes more than plain JAX when it counted the labels not ignored).
    def moved(loss):
        return _gradient_bytes(lambda p, t: loss(p, t, t, SMALL), data, model, **rules)

    plain = moved(plain_gpt_loss)
    assert moved(gpt_loss) <= plain
    assert moved(cannjax.optimize(plain_gpt_loss)) <= plain


def test_layer_loop_keeps_its_carry_placed_as_its_input_under_fsdp():
    # Under FSDP the partitioner placed the layer loop's carry [B, T, D] as the block's
    # weights are (D over data) rather than as the activations entering the loop (B over
    # data), plain JAX too: every device ran every sequence, and the carry was gathered
    # and scattered at every layer. The cannjax GPT groups the loop's result with its
    # input (parallel.placed_like) and optimize does so for every top-level scan
    # (optimization/loops.py): 2,453,760 bytes here against plain's 4,184,320 (before:
    # 4,200,704 and 4,184,320).
    def moved(loss):
        return _gradient_bytes(lambda p, t: loss(p, t, t, SMALL), 4, 2, fsdp="data")

    plain = moved(plain_gpt_loss)
    assert moved(gpt_loss) < 0.7 * plain
    assert moved(cannjax.optimize(plain_gpt_loss)) < 0.7 * plain


def test_placed_like_is_the_identity_with_a_gradient_for_y_only():
    x = rand.normal(jax.random.key(0), (8, 4))
    y = jnp.sin(x)

    def f(y, x):
        return jnp.sum(parallel.placed_like(y, x) ** 2)

    np.testing.assert_array_equal(parallel.placed_like(y, x), y)
    gy, gx = jax.grad(f, (0, 1))(y, x)
    np.testing.assert_allclose(gy, 2 * y, rtol=1e-6)
    np.testing.assert_array_equal(gx, jnp.zeros_like(x))
    _, t = jax.jvp(lambda y: parallel.placed_like(y, x), (y,), (jnp.ones_like(y),))
    np.testing.assert_array_equal(t, jnp.ones_like(y))
    batched = jax.vmap(parallel.placed_like, (0, None))(jnp.stack([y, 2 * y]), x)
    np.testing.assert_array_equal(batched, jnp.stack([y, 2 * y]))
    batched = jax.vmap(parallel.placed_like, (None, 0))(y, jnp.stack([x, x]))
    np.testing.assert_array_equal(batched, jnp.stack([y, y]))
    # One device: nothing is lowered; eight: both join one sharding group.
    assert "sharding_group" not in jax.jit(parallel.placed_like).lower(y, x).as_text()
    mesh = parallel.model_mesh(8, 1)
    rows = NamedSharding(mesh, P("data"))
    lowered = jax.jit(parallel.placed_like, in_shardings=(rows, rows)).lower(y, x)
    if jax.config.jax_use_shardy_partitioner:
        assert lowered.as_text().count("sdy.sharding_group") == 2


def test_optimize_places_the_carry_of_each_top_level_scan():
    def loss(w, x):
        y, _ = jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)
        return jnp.mean(y**2)

    w, x = jnp.full((3, 4, 4), 0.1), jnp.ones((8, 4))
    report = cannjax.inspect.optimize(loss, w, x)
    assert report.placed_loops == 1
    assert "carries of 1 loop(s) placed as their inputs" in repr(report)
    assert "cannjax_placed_like" in str(jax.make_jaxpr(cannjax.optimize(loss))(w, x))
    np.testing.assert_allclose(
        jax.grad(cannjax.optimize(loss))(w, x), jax.grad(loss)(w, x), rtol=1e-6
    )
    assert cannjax.inspect.optimize(lambda w, x: loss(w, x) + 0.0, w, x, level=1).placed_loops == 0


def test_placed_like_rejects_arrays_of_different_shapes():
    with pytest.raises(ValueError, match=r"placed_like: y and ref must have one shape"):
        parallel.placed_like(jnp.ones((4, 8)), jnp.ones((8, 4)))
    with pytest.raises(TypeError, match=r"placed_like: ref must be an array, got list"):
        parallel.placed_like(jnp.ones(3), [1.0, 2.0, 3.0])


def test_optimized_attention_keeps_its_heads_sharded():
    # jax.nn.dot_product_attention's causal mask covers every batch axis, heads too; once
    # it is `causal`, optimize hands the heads to ops.attention's head axis. Merged into
    # its batch axis, they were gathered under tensor parallelism: 19,394,560 bytes here
    # against the cannjax GPT's 14,127,104, whose attention takes the heads as written
    # (1.31x at benchmarks/sharding.py's size); now 14,389,248.
    def moved(loss):
        return _gradient_bytes(lambda p, t: loss(p, t, t, SMALL), 1, 8, tensor="model")

    ours = moved(gpt_loss)
    assert 0 < moved(cannjax.optimize(plain_gpt_loss)) <= 1.05 * ours


# ------------------------------------------------- data_parallel with sharded params
def _dp_setup(gpt):
    params, tokens = gpt
    batch = (tokens, jnp.roll(tokens, -1, axis=1))
    # A momentum state mirroring the parameters; SGD's update is linear in the gradient,
    # so rounding differences stay rounding-sized (Adam's m / sqrt(v) magnifies them
    # where a gradient is near zero).
    opt = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1, momentum=0.9))

    def loss_fn(p, b):
        return gpt_loss(p, *b, CFG)

    return params, batch, opt, loss_fn


@pytest.mark.parametrize(
    "kw",
    [
        pytest.param({"fsdp": "data"}, marks=pytest.mark.extended),
        pytest.param({"tensor": "model"}, marks=pytest.mark.extended),
        {"fsdp": "data", "tensor": "model"},
    ],
    ids=["fsdp", "tp", "both"],
)
def test_data_parallel_with_sharded_params_equals_the_replicated_step(gpt, kw):
    params, batch, opt, loss_fn = _dp_setup(gpt)
    mesh = parallel.model_mesh(4, 2)
    shardings = parallel.param_shardings(params, mesh, **kw)
    step = parallel.data_parallel(loss_fn, opt, param_shardings=shardings)
    replicated = parallel.data_parallel(loss_fn, opt, mesh=parallel.data_mesh())
    got = step(jax.device_put(params, shardings), opt.init(params), batch)
    want = replicated(params, opt.init(params), batch)
    # The state goes round: sharded in, sharded out.
    got = step(got.params, got.opt_state, batch)
    want = replicated(want.params, want.opt_state, batch)
    # clip_by_global_norm sees the whole gradient: the update runs on sharded arrays.
    for k in ("loss", "grad_norm"):
        np.testing.assert_allclose(got.metrics[k], want.metrics[k], rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))
    # Parameters and the momentum stay laid out as the rules say.
    for p, s in zip(jax.tree.leaves(got.params), jax.tree.leaves(shardings)):
        assert p.sharding == s
    same = optax.tree_map_params(
        opt, lambda x, s: x.sharding == s, got.opt_state, shardings,
        transform_non_params=lambda _: True,
    )  # fmt: skip
    assert all(jax.tree.leaves(same))


def test_data_parallel_fsdp_gathers_weights_not_activations(gpt):
    # Inside the shard_map each device gathers its parameters (all_gather) and keeps
    # its shard of the mean gradient (psum_scatter): ZeRO-3. The partitioner's FSDP
    # (jax.jit with the same shardings) gathers activations instead and moves more.
    params, batch, opt, loss_fn = _dp_setup(gpt)
    mesh = parallel.model_mesh(4, 2)
    shardings = parallel.param_shardings(params, mesh, fsdp="data")
    step = parallel.data_parallel(loss_fn, opt, param_shardings=shardings)
    compiled = step.lower(jax.device_put(params, shardings), opt.init(params), batch).compile()
    moved = parallel.collective_bytes(compiled)
    assert moved["reduce-scatter"] > 0 and moved["all-gather"] > 0
    rows = NamedSharding(mesh, P("data"))
    gspmd = jax.jit(jax.value_and_grad(loss_fn), in_shardings=(shardings, (rows, rows)))
    assert moved["total"] < parallel.collective_bytes(gspmd.lower(params, batch))["total"]


def test_data_parallel_reshard_after_forward_gathers_each_layer_twice(gpt):
    # reshard_after_forward=True: the stacked layer weights the GPT's layer loop reads are
    # gathered one layer at a time inside the loop and again in its backward (ZeRO-3),
    # where by default each is gathered whole once and kept: the same updates, more
    # all-gather bytes (217,856 against 119,040 here), less temp (195,344 bytes against
    # 358,280).
    params, batch, opt, loss_fn = _dp_setup(gpt)
    shardings = parallel.param_shardings(params, parallel.model_mesh(8, 1), fsdp="data")
    placed, state = jax.device_put(params, shardings), opt.init(params)
    whole = parallel.data_parallel(loss_fn, opt, param_shardings=shardings)
    layered = parallel.data_parallel(
        loss_fn, opt, param_shardings=shardings, reshard_after_forward=True
    )
    got, want = layered(placed, state, batch), whole(placed, state, batch)
    np.testing.assert_allclose(got.metrics["loss"], want.metrics["loss"], rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(w))))
    for p, s in zip(jax.tree.leaves(got.params), jax.tree.leaves(shardings)):
        assert p.sharding == s
    c_whole = whole.lower(placed, state, batch).compile()
    c_layered = layered.lower(placed, state, batch).compile()
    gathered = [parallel.collective_bytes(c)["all-gather"] for c in (c_whole, c_layered)]
    assert gathered[1] > gathered[0]
    temps = [c.memory_analysis().temp_size_in_bytes for c in (c_whole, c_layered)]
    assert temps[1] < temps[0]


def test_data_parallel_fsdp_skips_a_nonfinite_step(gpt):
    params, batch, opt, loss_fn = _dp_setup(gpt)
    shardings = parallel.param_shardings(params, parallel.model_mesh(4, 2), fsdp="data")
    step = parallel.data_parallel(
        lambda p, b: loss_fn(p, b) * jnp.inf, opt, param_shardings=shardings,
        skip_nonfinite=True,
    )  # fmt: skip
    start = jax.device_put(params, shardings)
    out = step(start, opt.init(params), batch)
    assert not bool(out.metrics["grads_finite"])
    for a, b in zip(jax.tree.leaves(out.params), jax.tree.leaves(start)):
        np.testing.assert_array_equal(a, b)


def test_data_parallel_bad_param_shardings(gpt):
    params, _, opt, loss_fn = _dp_setup(gpt)
    mesh = parallel.model_mesh(4, 2)
    shardings = parallel.param_shardings(params, mesh, fsdp="data")
    fn = "cannjax.parallel.data_parallel"
    with pytest.raises(ValueError, match=rf"{fn}: param_shardings\['embed'\] is on mesh"):
        parallel.data_parallel(
            loss_fn, opt, param_shardings=shardings, mesh=parallel.model_mesh(2, 4)
        )
    both = shardings._replace(embed=NamedSharding(mesh, P(("data", "model"))))
    with pytest.raises(ValueError, match=r"param_shardings\['embed'\] has spec .*one dimension"):
        parallel.data_parallel(loss_fn, opt, param_shardings=both)
    with pytest.raises(TypeError, match=r"param_shardings\['embed'\] must be a NamedSharding"):
        parallel.data_parallel(loss_fn, opt, param_shardings=shardings._replace(embed=P()))
    tp = parallel.param_shardings(params, parallel.model_mesh(1, 8), tensor="model")
    with pytest.raises(ValueError, match=rf"{fn}: .* data axis 'data' needs at least 2"):
        parallel.data_parallel(loss_fn, opt, param_shardings=tp)
    with pytest.raises(TypeError, match=rf"{fn}: param_shardings must be a pytree of"):
        parallel.data_parallel(loss_fn, opt, param_shardings={"w": P("data")})
    with pytest.raises(TypeError, match=rf"{fn}: reshard_after_forward must be a bool, got 1"):
        parallel.data_parallel(loss_fn, opt, param_shardings=shardings, reshard_after_forward=1)
    with pytest.raises(ValueError, match=rf"{fn}: reshard_after_forward=True applies to FSDP"):
        parallel.data_parallel(loss_fn, opt, reshard_after_forward=True)
