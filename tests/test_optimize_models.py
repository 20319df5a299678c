"""``cannjax.optimize`` on the user-style models of ``benchmarks/_user_models.py`` (issue 16).

For each model at a small shape: the gradients of the optimized loss equal the plain
loss's, ``cannjax.inspect.optimize`` names every attention, norm, dense layer, activation
and loss of the model as replaced (counts derived from the model's structure), and the
saved residuals shrink.

The shape keeps activations larger than weights (``B * T = 128`` tokens against width 32),
as in training: saved weights count as residuals too, and at fewer tokens they dominate
the ratio.
"""

import collections

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import cannjax
import cannjax.models
from benchmarks import _user_models as U
from cannjax._src.optimization import rewrite
from tests import _rng as rand

S = U.Shape(vocab=64, width=32, heads=2, layers=2, seq_len=32, batch=4)
MLP_SIZES = (16, 32, 32, 10)


@pytest.fixture(autouse=True)
def _user_broadcasting():
    # The user models broadcast [B, T, D] + [T, D] as users write it; the suite's strict
    # rank-promotion setting would reject that code before optimize sees it.
    with jax.numpy_rank_promotion("allow"):
        yield


def _transformer_counts(layers_in_program):
    """Replacements of a GPT whose program holds ``layers_in_program`` blocks.

    Per block: ln1, ln2 (norm); q, k, v, out projections and fc1, fc2 (dense); the
    attention; gelu. Then ln_f, and the head followed by the cross-entropy, which becomes
    one linear_cross_entropy (a loss, not a dense layer).
    """
    n = layers_in_program
    return {"attention": n, "norm": 2 * n + 1, "dense": 6 * n, "activation": n, "loss": 1}


def _nnx_case(scan):
    model = U.NnxGPT(S, scan=scan, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def loss(state, tokens, targets):
        return U.nnx_loss(nnx.merge(graphdef, state), tokens, targets)

    # Under nnx.scan the program holds the block once, as the scan body.
    return loss, (state, *U.batch(S)), _transformer_counts(1 if scan else S.layers)


def _eqx_case():
    params, static = eqx.partition(U.EqxGPT(S, jax.random.key(0)), eqx.is_array)

    def loss(params, tokens, targets):
        return U.eqx_loss(eqx.combine(params, static), tokens, targets)

    return loss, (params, *U.batch(S)), _transformer_counts(S.layers)


def _mlp_case():
    params = U.init_mlp(jax.random.key(0), MLP_SIZES)
    x = rand.normal(jax.random.key(1), (16, MLP_SIZES[0]))
    labels = rand.randint(jax.random.key(2), (16,), 0, MLP_SIZES[-1])
    layers = len(MLP_SIZES) - 1
    # The last layer has a bias, so its logits stay: a plain cross-entropy.
    return U.mlp_loss, (params, x, labels), {"dense": layers, "activation": layers - 1, "loss": 1}


def _plain_gpt_case():
    cfg = cannjax.models.GPTConfig(
        vocab=S.vocab, width=S.width, heads=S.heads, layers=S.layers, seq_len=S.seq_len
    )
    params = cannjax.models.init_gpt(jax.random.key(0), cfg)

    def loss(params, tokens, targets):
        return cannjax.models.plain_gpt_loss(params, tokens, targets, cfg)

    # Layers under lax.scan: one block in the program; its q, k, v projection is one
    # fused matmul, so 4 dense layers per block (qkv, out, fc1, fc2).
    counts = {"attention": 1, "norm": 3, "dense": 4, "activation": 1, "loss": 1}
    return loss, (params, *U.batch(S)), counts


CASES = {
    "nnx_list": lambda: _nnx_case(scan=False),
    "nnx_scan": lambda: _nnx_case(scan=True),
    "equinox": _eqx_case,
    "mlp": _mlp_case,
    "plain_gpt": _plain_gpt_case,
}
TRANSFORMERS = ("nnx_list", "nnx_scan", "equinox", "plain_gpt")


@pytest.mark.parametrize("name", list(CASES))
def test_model(name):
    loss, args, counts = CASES[name]()
    opt = cannjax.optimize(loss)
    v1, g1 = jax.jit(jax.value_and_grad(opt))(*args)
    v0, g0 = jax.jit(jax.value_and_grad(loss))(*args)
    np.testing.assert_allclose(v1, v0, rtol=1e-5, atol=1e-6)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g1, g0
    )

    report = cannjax.inspect.optimize(opt, *args)
    assert report.counts() == counts, str(report)
    loss_ops = [r.op for r in report.replaced if r.kind == "loss"]
    if name in TRANSFORMERS:
        assert loss_ops == ["linear_cross_entropy"], str(report)
    before, after = report.residual_bytes
    if name in TRANSFORMERS:
        assert after <= 0.5 * before, f"{name}: residual bytes {before} -> {after}"
    else:
        assert after < before, f"{name}: residual bytes {before} -> {after}"


def test_nnx_value_and_grad_user_style():
    # What an nnx user writes: nnx.jit of nnx.value_and_grad over the module itself.
    model = U.NnxGPT(S, rngs=nnx.Rngs(0))
    tokens, targets = U.batch(S)

    def step(loss):
        return nnx.jit(lambda m, a, b: nnx.value_and_grad(loss)(m, a, b))

    v1, g1 = step(cannjax.optimize(U.nnx_loss))(model, tokens, targets)
    v0, g0 = step(U.nnx_loss)(model, tokens, targets)
    np.testing.assert_allclose(v1, v0, rtol=1e-5, atol=1e-6)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        nnx.state(g1),
        nnx.state(g0),
    )


@pytest.mark.parametrize(
    "scan",
    [True, pytest.param(False, marks=pytest.mark.extended)],  # extended: 11 s, the same path
    ids=["nnx_scan", "nnx_list"],
)
def test_activations_and_norms_read_by_projections_are_recomputed_in_the_backward(
    scan, monkeypatch
):
    # Under nnx.scan, gelu runs with fc2, and each LayerNorm with the projections that
    # read it (query, key and value; fc1), under jax.checkpoint: the layer saves fc1's
    # output [B, T, 4D] and the residual stream alone, where gelu's output and both
    # norms' outputs [B, T, D] were saved as well. In layers written out one after
    # another gelu runs with fc2 as one operator that recomputes it from its input and
    # the cotangent (optimization/recompute.py); the norms are left unpaired there.
    loss, args, _ = _nnx_case(scan)
    report = cannjax.inspect.optimize(loss, *args)
    paired_rows = [r for r in report.replaced if r.kind in ("activation", "norm")]
    assert {r.kind for r in paired_rows} == {"activation", "norm"}
    # Norms inside the loop body only: the final LayerNorm (read by the head and the
    # loss) never is.
    expect = [r.kind == "activation" or (scan and r.runs == S.layers) for r in paired_rows]
    assert [("recomputed in the backward" in r.source) for r in paired_rows] == expect
    state, rest = args[0], args[1:]
    t = jax.tree.map(np.ones_like, state)

    def derivatives(fn):
        grads = jax.jit(jax.grad(lambda s: fn(s, *rest)))(state)
        return grads, jax.jvp(lambda s: fn(s, *rest), (state,), (t,))[1]

    def shapes():
        rows = cannjax.inspect.residuals(cannjax.optimize(loss), *args).rows
        return collections.Counter(r.shape for r in rows)

    paired, after = derivatives(cannjax.optimize(loss)), shapes()
    monkeypatch.setattr(rewrite, "recompute_producers", lambda g, reps, in_loop: {})
    without = shapes()
    stacked = (S.layers,) if scan else ()
    hidden, width = (
        (*stacked, S.batch, S.seq_len, 4 * S.width),
        (*stacked, S.batch, S.seq_len, S.width),
    )
    # gelu(h) no longer saved; in the loop body ln1(x), ln2(x) neither
    saved = (without[hidden] - after[hidden], without[width] - after[width])
    assert saved == ((1, 2) if scan else (S.layers, 0))
    unpaired = derivatives(cannjax.optimize(loss))
    # The recomputation repeats the same operations; XLA may fuse the recomputed norm's
    # reductions differently, so the results agree to float32 rounding (bit for bit when
    # only activations are recomputed), measured against the largest gradient.
    largest = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(unpaired[0]))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * largest),
        paired[0],
        unpaired[0],
    )
    np.testing.assert_allclose(paired[1], unpaired[1], rtol=1e-6)
    np.testing.assert_allclose(paired[1], derivatives(loss)[1], rtol=1e-4)


def test_xla_cpu_merges_a_recomputation_across_an_optimization_barrier():
    # Why optimize pairs under jax.checkpoint in loop bodies only (docs/optimize.md):
    # XLA:CPU drops optimization barriers before common-subexpression elimination, so
    # sin of x behind a barrier is the forward's sin(x) again. If this starts to fail,
    # jax.checkpoint recomputes in unrolled code too and could pair norms there.
    if jax.default_backend() != "cpu":
        pytest.skip("a fact about XLA:CPU")

    def f(x, g):
        return jnp.sin(x) * 2 + jnp.sin(jax.lax.optimization_barrier(x)) * g

    hlo = jax.jit(f).lower(jnp.ones(64), jnp.ones(64)).compile().as_text()
    assert hlo.count(" sine(") == 1
