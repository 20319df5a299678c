"""The GPT of cannjax.models: the cannjax model against its plain-JAX twin (logits, loss
and every gradient), as ``benchmarks/gpt.py`` and the demo assume."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cannjax.models import (
    GPTConfig,
    gpt_logits,
    gpt_loss,
    init_gpt,
    plain_gpt_logits,
    plain_gpt_loss,
)
from tests import _rng as rand

TINY = dict(vocab=32, width=32, heads=4, layers=2, seq_len=8)
SMALL = dict(vocab=128, width=64, heads=4, layers=2, seq_len=32)


def _params(cfg):
    """Initial weights moved off their special values (unit scales, zero biases)."""
    params = init_gpt(jax.random.key(0), cfg)
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    moved = [p + 0.05 * rand.normal(k, p.shape, p.dtype) for p, k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(tree, moved)


def _data(cfg, batch=2):
    k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
    tokens = rand.randint(k1, (batch, cfg.seq_len), 0, cfg.vocab)
    targets = rand.randint(k2, (batch, cfg.seq_len), 0, cfg.vocab)
    weights = (rand.uniform(k3, (batch, cfg.seq_len)) < 0.6).astype(jnp.float32)
    return tokens, targets, weights


def _max_rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize(
    "config,remat,weighted",
    [
        (SMALL, "none", False),  # as benchmarks/gpt.py and the demo use it
        pytest.param(TINY, "layer", True, marks=pytest.mark.extended),
    ],
    ids=["small", "tiny-remat-weighted"],
)
def test_gpt_loss_equals_plain_gpt_loss_values_and_gradients(config, remat, weighted):
    cfg = GPTConfig(**config, remat=remat)
    params = _params(cfg)
    tokens, targets, weights = _data(cfg)
    weights = weights if weighted else None

    logits = jax.jit(gpt_logits, static_argnums=2)(params, tokens, cfg)
    plain_logits = jax.jit(plain_gpt_logits, static_argnums=2)(params, tokens, cfg)
    assert logits.shape == (2, cfg.seq_len, cfg.vocab) and logits.dtype == jnp.float32
    assert _max_rel(logits, plain_logits) <= 1e-5

    def value_and_grad(loss_fn):
        return jax.jit(jax.value_and_grad(loss_fn), static_argnums=3)(
            params, tokens, targets, cfg, weights
        )

    (loss, grads), (plain_loss, plain_grads) = map(value_and_grad, (gpt_loss, plain_gpt_loss))
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-5)
    assert 0.5 * np.log(cfg.vocab) < float(loss) < 2 * np.log(cfg.vocab)  # near chance
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    plain_leaves = jax.tree_util.tree_leaves(plain_grads)
    assert len(leaves) == len(plain_leaves) == 14  # 5 top-level weights, 9 per block
    for (path, g), p in zip(leaves, plain_leaves):
        where = jax.tree_util.keystr(path)
        assert g.shape == p.shape and g.dtype == jnp.float32, where
        assert float(jnp.max(jnp.abs(p))) > 0, where
        assert _max_rel(g, p) <= 1e-5, (where, _max_rel(g, p))


def _same_to_rounding(a, b):
    scale = float(np.max(np.abs(b), initial=0.0))
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * scale)


def test_each_block_saves_its_mlp_hidden_and_residual_stream_once(monkeypatch):
    # Each norm runs with the projection after it, and gelu with the second MLP matmul,
    # under jax.checkpoint (models/recompute.py): the block saves x (the norm's input) and
    # h [B, T, 4D] (gelu's) and recomputes ln(x) and gelu(h) for the matmuls' backward,
    # where plain autodiff (and the model before) saved both sides of each pair.
    from cannjax._src.models import gpt
    from cannjax.inspect import residuals

    cfg = GPTConfig(**SMALL)
    params = _params(cfg)
    tokens, targets, _ = _data(cfg)
    hidden = (cfg.layers, 2, cfg.seq_len, cfg.mlp_ratio * cfg.width)
    width = (cfg.layers, 2, cfg.seq_len, cfg.width)

    def saved(loss_fn):
        rows = residuals(lambda p: loss_fn(p, tokens, targets, cfg), params).rows
        return sum(r.shape == hidden for r in rows), sum(r.shape == width for r in rows)

    def grads(loss_fn):
        return jax.jit(jax.grad(loss_fn), static_argnums=3)(params, tokens, targets, cfg)

    hid, wide = saved(gpt_loss)
    assert hid == 1
    assert saved(plain_gpt_loss)[0] == 6  # h, gelu(h) and gelu's own intermediates
    new = grads(gpt_loss)
    ops = gpt._cannjax_ops()
    for fields, more in (
        ({"recompute_norm": False}, (0, 2)),  # ln1(x) and ln2(x) saved too
        ({"recompute_norm": False, "recompute_activation": False}, (1, 2)),  # and gelu(h)
    ):
        monkeypatch.setattr(gpt, "_cannjax_ops", lambda f=fields: ops._replace(**f))
        assert saved(gpt_loss) == (hid + more[0], wide + more[1]), fields
        # The recomputation repeats the same operations: the same gradients (bit for bit
        # under XLA's default codegen; to the last bits under the suite's, conftest.py).
        jax.tree.map(_same_to_rounding, grads(gpt_loss), new)
    monkeypatch.undo()
    # Forward mode goes through the checkpoints too.
    t = jax.tree.map(jnp.ones_like, params)

    def jvp(loss_fn):
        return jax.jvp(lambda p: loss_fn(p, tokens, targets, cfg), (params,), (t,))[1]

    np.testing.assert_allclose(jvp(gpt_loss), jvp(plain_gpt_loss), rtol=1e-4)
