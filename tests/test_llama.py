"""The Llama-style model of cannjax.models: the cannjax model against its plain-JAX twin
(values and gradients), what its attention receives, compiled memory at the size of
issue 23's target, config errors, and the demo's ``--model llama``."""

import argparse
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cannjax._src import demo
from cannjax._src.cli import main
from cannjax._src.models import llama
from cannjax._src.models.tasks import SortTask
from cannjax.models import (
    LlamaConfig,
    init_llama,
    llama_logits,
    llama_loss,
    plain_llama_logits,
    plain_llama_loss,
)
from tests import _rng as rand

TINY = dict(vocab=32, width=32, heads=4, kv_heads=2, layers=2, seq_len=8, hidden=64)
# Long enough that the plain twin's [B, N, T, T] attention dominates its step's memory.
SMALL = dict(vocab=256, width=64, heads=8, kv_heads=2, layers=2, seq_len=256, hidden=192)
# Issue 23's target: 4 layers, d=256, 8 heads, 2 kv heads, T=512, B=4 (hidden 8d/3
# rounded up to a multiple of 64; the vocabulary of the GPT benchmarks).
TARGET = dict(vocab=1024, width=256, heads=8, kv_heads=2, layers=4, seq_len=512, hidden=704)


def _data(cfg, batch=2, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    tokens = rand.randint(k1, (batch, cfg.seq_len), 0, cfg.vocab)
    targets = rand.randint(k2, (batch, cfg.seq_len), 0, cfg.vocab)
    weights = (rand.uniform(k3, (batch, cfg.seq_len)) < 0.6).astype(jnp.float32)
    return tokens, targets, weights


def _max_rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def _compiled_value_and_grad(loss_fn, params, tokens, targets, cfg, weights):
    step = jax.jit(jax.value_and_grad(loss_fn), static_argnums=3)
    return step.lower(params, tokens, targets, cfg, weights).compile()


@pytest.mark.parametrize(
    "config,tie,remat,weighted",
    [(SMALL, True, "none", False), (TINY, False, "layer", True)],
    ids=["small-tied", "tiny-untied-remat-weighted"],
)
def test_cannjax_model_equals_its_plain_twin(config, tie, remat, weighted):
    cfg = LlamaConfig(**config, tie_embeddings=tie, remat=remat)
    params = init_llama(jax.random.key(0), cfg)
    assert (params.head is None) is tie
    tokens, targets, weights = _data(cfg)
    weights = weights if weighted else None
    if tie:
        logits = jax.jit(llama_logits, static_argnums=2)(params, tokens, cfg)
        plain_logits = jax.jit(plain_llama_logits, static_argnums=2)(params, tokens, cfg)
        assert logits.shape == (2, cfg.seq_len, cfg.vocab)
        np.testing.assert_allclose(logits, plain_logits, rtol=1e-5, atol=1e-6)
    ours, plain = (
        _compiled_value_and_grad(f, params, tokens, targets, cfg, weights)
        for f in (llama_loss, plain_llama_loss)
    )
    (loss, grads), (plain_loss, plain_grads) = (
        c(params, tokens, targets, weights) for c in (ours, plain)
    )
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
    assert 0.5 * np.log(cfg.vocab) < float(loss) < 2 * np.log(cfg.vocab)  # near chance
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    plain_leaves = jax.tree_util.tree_leaves(plain_grads)
    assert len(leaves) == len(plain_leaves) == 9 + (not tie)
    for (path, g), p in zip(leaves, plain_leaves):
        assert float(jnp.max(jnp.abs(p))) > 0, jax.tree_util.keystr(path)
        assert _max_rel(g, p) <= 1e-5, jax.tree_util.keystr(path)
    if config is SMALL:  # the fast twin of the target-size memory test below
        temp = [c.memory_analysis().temp_size_in_bytes for c in (ours, plain)]
        assert temp[0] <= 0.5 * temp[1], temp  # 7.4 MiB against 37.8 MiB


def test_plain_rope_is_the_rotation_by_position_times_frequency():
    # Pairs (i, i + H/2) as complex numbers, turned by positions * theta^(-2i/H): the
    # plain twin (and so the cannjax model, which equals it) uses the half-split layout.
    x = np.random.default_rng(0).standard_normal((1, 5, 2, 8)).astype(np.float32)
    pos = np.array([0, 1, 2, 7, 100])
    inv_freq = 500.0 ** (-np.arange(0, 8, 2) / 8)
    z = (x[..., :4] + 1j * x[..., 4:]) * np.exp(1j * pos[None, :, None, None] * inv_freq)
    expected = np.concatenate([z.real, z.imag], -1)
    np.testing.assert_allclose(llama._plain_rope(x, jnp.asarray(pos), 500.0), expected, atol=2e-5)


def _attention_inputs(jaxpr):
    """Shapes of (q, k, v) of every cannjax attention in ``jaxpr`` and its sub-jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        rule = eqn.params.get("rule")
        if eqn.primitive.name == "cannjax_op" and rule.name == "attention":
            found.append(tuple(v.aval.shape for v in eqn.invars[:3]))
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    found += _attention_inputs(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    found += _attention_inputs(sub)
    return found


def test_attention_gets_kv_heads_not_repeated():
    cfg = LlamaConfig(**TINY)
    params = init_llama(jax.random.key(0), cfg)
    tokens, targets, _ = _data(cfg)
    closed = jax.make_jaxpr(llama_loss, static_argnums=3)(params, tokens, targets, cfg)
    b, t, h = 2, cfg.seq_len, cfg.head_dim
    q, k, v = (b, t, cfg.heads, h), (b, t, cfg.kv_heads, h), (b, t, cfg.kv_heads, h)
    assert _attention_inputs(closed.jaxpr) == [(q, k, v)]  # one call, in the scanned body


def test_each_block_saves_the_residual_stream_not_its_norms(monkeypatch):
    # Each RMS norm runs with the projections after it (w_qkv; the SwiGLU MLP) under
    # jax.checkpoint with the operators' own residuals kept (models/recompute.py): the block
    # saves x, not rms_norm(x) beside it, and keeps swiglu's two [B, T, F]
    # pre-activations (they are named residuals: not recomputed).
    from cannjax._src.models import llama
    from cannjax.inspect import residuals

    cfg = LlamaConfig(**TINY)
    params = init_llama(jax.random.key(0), cfg)
    tokens, targets, _ = _data(cfg)
    width = (cfg.layers, 2, cfg.seq_len, cfg.width)
    hidden = (cfg.layers, 2, cfg.seq_len, cfg.hidden)

    def saved():
        rows = residuals(lambda p: llama_loss(p, tokens, targets, cfg), params).rows
        return sum(r.shape == width for r in rows), sum(r.shape == hidden for r in rows)

    def grads():
        return jax.jit(jax.grad(llama_loss), static_argnums=3)(params, tokens, targets, cfg)

    (wide, hid), new = saved(), grads()
    assert hid == 2  # swiglu's a = x W_gate and b = x W_up
    ops = llama._cannjax_ops()
    monkeypatch.setattr(llama, "_cannjax_ops", lambda: ops._replace(recompute_norm=False))
    assert saved() == (wide + 2, hid)
    jax.tree.map(np.testing.assert_array_equal, grads(), new)  # the same operations


def _temp_bytes(loss_fn, cfg, batch):
    params = jax.eval_shape(lambda: init_llama(jax.random.key(0), cfg))
    tokens = jax.ShapeDtypeStruct((batch, cfg.seq_len), jnp.int32)
    compiled = _compiled_value_and_grad(loss_fn, params, tokens, tokens, cfg, None)
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.extended
def test_step_temp_memory_at_the_target_size_is_below_half_of_plain():
    # jax 0.10.2, XLA:CPU: 150.4 MiB against 609.3 MiB (0.25x); the plain twin's
    # [B, N, T, T] attention probabilities are stacked over the scanned layers.
    cfg = LlamaConfig(**TARGET)
    ours, plain = (_temp_bytes(f, cfg, 4) for f in (llama_loss, plain_llama_loss))
    assert ours <= 0.5 * plain, (ours / 2**20, plain / 2**20)


@pytest.mark.parametrize(
    "change,error,message",
    [
        ({"kv_heads": 3}, ValueError, "kv_heads=3 must divide heads=4 (each key/value head"),
        ({"width": 20}, ValueError, "the head dim width / heads = 5 must be even"),
        ({"width": 24, "heads": 8}, ValueError, "the head dim width / heads = 3 must be even"),
        ({"heads": 3, "kv_heads": 1}, ValueError, "heads=3 must divide width=32"),
        ({"hidden": 0}, ValueError, "hidden must be a positive int, got 0"),
        ({"kv_heads": 2.0}, ValueError, "kv_heads must be a positive int, got 2.0"),
        ({"rope_theta": 0.0}, ValueError, "rope_theta must be a positive finite float"),
        ({"norm_eps": -1e-6}, ValueError, "norm_eps must be a positive finite float"),
        ({"tie_embeddings": 1}, TypeError, "tie_embeddings must be a bool, got 1"),
        ({"remat": "full"}, ValueError, "remat must be 'none' or 'layer', got 'full'"),
    ],
)
def test_config_errors_name_the_field_and_the_fix(change, error, message):
    with pytest.raises(error) as e:
        LlamaConfig(**{**TINY, **change})
    assert str(e.value).startswith("cannjax.models.LlamaConfig: ") and message in str(e.value)


def test_config_is_static_and_params_must_match_it():
    cfg = LlamaConfig(**TINY)
    assert hash(cfg) == hash(LlamaConfig(**TINY)) and cfg.head_dim == 8
    untied = LlamaConfig(**TINY, tie_embeddings=False)
    tokens = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="have no head .tied. but cfg.tie_embeddings=False"):
        jax.eval_shape(
            lambda p: llama_loss(p, tokens, tokens, untied), init_llama(jax.random.key(0), cfg)
        )
    with pytest.raises(ValueError, match="tokens of length 9 exceed the model's seq_len=8"):
        jax.eval_shape(
            lambda p: llama_logits(p, jnp.zeros((1, 9), jnp.int32), cfg),
            init_llama(jax.random.key(0), cfg),
        )


def test_demo_builds_a_grouped_query_llama_from_its_options(tmp_path):
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    assert p.parse_args([]).model == "gpt"  # the default stays the GPT
    args = p.parse_args(["--model", "llama", "--width", "256", "--heads", "8", "--out",
                         str(tmp_path)])  # fmt: skip
    cfg = demo._check(args)
    assert isinstance(cfg, LlamaConfig)
    assert (cfg.kv_heads, cfg.hidden, cfg.remat) == (4, 704, "layer")
    args = p.parse_args(["--model", "llama", "--kv-heads", "1", "--out", str(tmp_path)])
    assert demo._check(args).kv_heads == 1
    assert demo.llama_hidden(32) == 96 and demo.llama_hidden(128) == 352


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "llama", "--kv-heads", "3"], "--kv-heads=3 must divide --heads=4"),
        (["--model", "llama", "--kv-heads", "0"], "--kv-heads must be >= 1, got 0"),
        (["--kv-heads", "2"], "--kv-heads applies to --model llama only"),
        (["--model", "llama", "--width", "36", "--heads", "4"], "even head dim"),
        (["--model", "mistral"], "invalid choice: 'mistral'"),
    ],
)
def test_demo_llama_bad_options_are_clear_errors(argv, message, capsys):
    try:
        code = main(["demo", *argv])
    except SystemExit as e:  # argparse's own errors (an unknown --model)
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_demo_help_lists_model_and_kv_heads(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "--model {gpt,llama}" in out and "--kv-heads KV_HEADS" in out


def test_demo_training_step_trains_the_llama():
    # The demo's step (amp loss scaling, clipping, Adam) with the tied head (None leaf).
    task = SortTask(digits=4)
    cfg = LlamaConfig(vocab=task.vocab, width=32, heads=4, kv_heads=2, layers=1,
                      seq_len=task.seq_len, hidden=96, remat="layer")  # fmt: skip
    params = init_llama(jax.random.key(0), cfg)
    args = argparse.Namespace(steps=4, lr=3e-3, seed=0, batch=8, quiet=True)
    trained, run, mem = demo._train("cannjax", llama_loss, params, cfg, task, args, 4)
    assert trained.head is None and len(run["losses"]) == 4 and np.isfinite(run["losses"]).all()
    assert run["losses"][-1] < run["losses"][0]
    assert mem["temp_bytes"] > 0 and mem["residual_bytes"] > 0


@pytest.mark.extended
def test_demo_model_llama_tiny_run(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["demo", "--model", "llama", "--steps", "3", "--plain-steps", "2", "--width",
            "32", "--layers", "1", "--batch", "8", "--digits", "4", "--out", str(out),
            "--quiet"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "cannjax demo: Llama (L=1, D=32, N=4, K=2 kv heads, F=96, T=8, V=11)" in text
    assert re.search(r"^cannjax\s+float32\s", text, re.M)
    assert re.search(r"^plain JAX\s+float32\s", text, re.M)
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["model"] == "llama" and report["model"]["kv_heads"] == 2
    assert report["grad_max_rel_difference"] < 1e-5
    assert len(report["runs"]["cannjax"]["losses"]) == 3
    assert report["memory"]["cannjax"]["temp_bytes"] > 0
