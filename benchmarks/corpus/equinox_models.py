"""equinox: a Llama from ``eqx.nn`` layers, per-example modules ``vmap``-ed over the batch.

``eqx.nn.MultiheadAttention`` (no grouped-query option) with
``eqx.nn.RotaryPositionalEmbedding`` applied in ``process_heads``, ``eqx.nn.RMSNorm``, a
SwiGLU MLP of ``eqx.nn.Linear``, an untied head; the loss is
``optax.softmax_cross_entropy_with_integer_labels`` over ``eqx.partition``-ed parameters.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from . import Model, Size, counts


class Block(eqx.Module):
    attn_norm: eqx.nn.RMSNorm
    attn: eqx.nn.MultiheadAttention
    rope: eqx.nn.RotaryPositionalEmbedding
    mlp_norm: eqx.nn.RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, size: Size, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        d, f = size.width, size.ffn
        self.attn_norm = eqx.nn.RMSNorm(d, eps=1e-6, use_bias=False)
        self.attn = eqx.nn.MultiheadAttention(size.heads, d, key=k1)
        self.rope = eqx.nn.RotaryPositionalEmbedding(size.head_dim)
        self.mlp_norm = eqx.nn.RMSNorm(d, eps=1e-6, use_bias=False)
        self.gate = eqx.nn.Linear(d, f, use_bias=False, key=k2)
        self.up = eqx.nn.Linear(d, f, use_bias=False, key=k3)
        self.down = eqx.nn.Linear(f, d, use_bias=False, key=k4)

    def __call__(self, x, mask):  # x: [T, D]
        def process_heads(q, k, v):
            rope = jax.vmap(self.rope, in_axes=1, out_axes=1)
            return rope(q), rope(k), v

        h = jax.vmap(self.attn_norm)(x)
        x = x + self.attn(h, h, h, mask=mask, process_heads=process_heads)
        h = jax.vmap(self.mlp_norm)(x)
        return x + jax.vmap(lambda t: self.down(jax.nn.silu(self.gate(t)) * self.up(t)))(h)


class LM(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    norm: eqx.nn.RMSNorm
    lm_head: eqx.nn.Linear

    def __init__(self, size: Size, key):
        ke, kh, *kb = jax.random.split(key, 2 + size.layers)
        self.embed = eqx.nn.Embedding(size.vocab, size.width, key=ke)
        self.blocks = [Block(size, k) for k in kb]
        self.norm = eqx.nn.RMSNorm(size.width, eps=1e-6, use_bias=False)
        self.lm_head = eqx.nn.Linear(size.width, size.vocab, use_bias=False, key=kh)

    def __call__(self, tokens):  # tokens: [T]
        x = jax.vmap(self.embed)(tokens)
        mask = jnp.tril(jnp.ones((tokens.shape[0],) * 2, dtype=bool))
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(self.lm_head)(jax.vmap(self.norm)(x))


def llama(size: Size, seed: int = 0):
    params, static = eqx.partition(LM(size, jax.random.key(seed)), eqx.is_inexact_array)
    key = jax.random.key(seed + 1)
    tokens = jax.random.randint(key, (size.batch, size.seq + 1), 0, size.vocab)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def loss(params, batch):
        logits = jax.vmap(eqx.combine(params, static))(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return params, batch, loss


MODELS = (
    Model(
        "equinox-llama", "equinox", ("RoPE", "SwiGLU", "RMS norm", "vmapped modules"), llama, counts
    ),
)
