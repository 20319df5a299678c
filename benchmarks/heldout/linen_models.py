"""flax.linen: a GPT from linen's own layers and a Llama-style decoder written in linen.

``linen-gpt``: ``nn.MultiHeadDotProductAttention`` with ``nn.make_causal_mask``,
``nn.LayerNorm``, a GELU MLP of ``nn.Dense``, learned positions, the embedding tied to the
head (``nn.Embed.attend``), ``optax.softmax_cross_entropy`` of ``jax.nn.one_hot`` labels.
``linen-llama``: ``nn.RMSNorm``, interleaved rotary embeddings, grouped-query heads in a
grouped einsum, a SwiGLU MLP of ``nn.Dense(use_bias=False)``, the loss as ``logsumexp -
the label's logit``. In mixed precision the modules take linen's ``dtype=`` (their
computation's dtype; the parameters stay in the default ``param_dtype=float32``).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from . import Model, Size, counts, tokens


class GPTBlock(nn.Module):
    size: Size
    dtype: Any = None

    @nn.compact
    def __call__(self, x, mask):
        s, dtype = self.size, self.dtype
        h = nn.LayerNorm(dtype=dtype)(x)
        x = x + nn.MultiHeadDotProductAttention(
            num_heads=s.heads, qkv_features=s.width, dtype=dtype
        )(h, h, mask=mask)
        h = nn.LayerNorm(dtype=dtype)(x)
        return x + nn.Dense(s.width, dtype=dtype)(nn.gelu(nn.Dense(s.ffn, dtype=dtype)(h)))


class GPT(nn.Module):
    size: Size
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens):
        s = self.size
        embed = nn.Embed(s.vocab, s.width, dtype=self.dtype)
        positions = self.param("positions", nn.initializers.normal(0.02), (s.seq, s.width))
        x = embed(tokens) + positions[: tokens.shape[1]]
        mask = nn.make_causal_mask(tokens)
        for _ in range(s.layers):
            x = GPTBlock(s, self.dtype)(x, mask)
        return embed.attend(nn.LayerNorm(dtype=self.dtype)(x))


def gpt(size: Size, seed: int = 0, compute=None):
    model = GPT(size, compute)
    batch = tokens(size, seed)
    params = model.init(jax.random.key(seed), batch["tokens"][:, :-1])

    def loss(params, batch):
        logits = model.apply(params, batch["tokens"][:, :-1])
        targets = jax.nn.one_hot(batch["tokens"][:, 1:], size.vocab)
        return optax.softmax_cross_entropy(logits, targets).mean()

    return params, batch, loss


def _rope_interleaved(x, base=10000.0):
    """x [B, T, H, D]: pairs (2i, 2i + 1) rotated by position * base^(-2i / D)."""
    t, d = x.shape[1], x.shape[-1]
    freqs = base ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angles = jnp.outer(jnp.arange(t, dtype=jnp.float32), freqs)  # [T, D/2]
    cos = jnp.repeat(jnp.cos(angles), 2, axis=-1)[None, :, None, :]
    sin = jnp.repeat(jnp.sin(angles), 2, axis=-1)[None, :, None, :]
    rotated = jnp.stack([-x[..., 1::2], x[..., ::2]], axis=-1).reshape(x.shape)
    return x * cos + rotated * sin


class LlamaAttention(nn.Module):
    size: Size
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        s, dense = self.size, functools.partial(nn.Dense, use_bias=False, dtype=self.dtype)
        b, t, _ = x.shape
        groups = s.heads // s.kv_heads
        q = dense(s.heads * s.head_dim)(x).reshape(b, t, s.heads, s.head_dim)
        k = dense(s.kv_heads * s.head_dim)(x)
        v = dense(s.kv_heads * s.head_dim)(x)
        k = k.reshape(b, t, s.kv_heads, s.head_dim)
        v = v.reshape(b, t, s.kv_heads, s.head_dim)
        q, k = _rope_interleaved(q), _rope_interleaved(k)
        q = q.reshape(b, t, s.kv_heads, groups, s.head_dim) * s.head_dim**-0.5
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k)
        causal = nn.make_causal_mask(jnp.ones((b, t)))[:, :, None]  # [B, 1, 1, T, T]
        scores = jnp.where(causal, scores, -1e9)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, -1)
        return dense(s.width)(out)


class Llama(nn.Module):
    size: Size
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens):
        s = self.size
        dense = functools.partial(nn.Dense, use_bias=False, dtype=self.dtype)
        norm = functools.partial(nn.RMSNorm, epsilon=1e-6, dtype=self.dtype)
        x = nn.Embed(s.vocab, s.width, dtype=self.dtype)(tokens)
        for _ in range(s.layers):
            x = x + LlamaAttention(s, self.dtype)(norm()(x))
            h = norm()(x)
            gate, up = dense(s.ffn)(h), dense(s.ffn)(h)
            x = x + dense(s.width)(nn.silu(gate) * up)
        return dense(s.vocab)(norm()(x))


def llama(size: Size, seed: int = 0, compute=None):
    model = Llama(size, compute)
    batch = tokens(size, seed)
    params = model.init(jax.random.key(seed), batch["tokens"][:, :-1])

    def loss(params, batch):
        logits = model.apply(params, batch["tokens"][:, :-1])
        labels = batch["tokens"][:, 1:]
        label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - label_logits)

    return params, batch, loss


MODELS = (
    Model(
        "linen-gpt",
        "flax",
        ("nn.MultiHeadDotProductAttention", "layer norm", "GELU", "tied embeddings"),
        gpt,
        lambda size: counts(size, dense_per_layer=6, rope=False),
        "every module's dtype=jnp.bfloat16",
    ),
    Model(
        "linen-llama",
        "flax",
        ("GQA by grouped einsum", "RMS norm", "interleaved RoPE", "SwiGLU"),
        llama,
        lambda size: counts(size, dense_per_layer=7),
        "every module's dtype=jnp.bfloat16",
    ),
)
