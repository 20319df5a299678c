"""haliax (named axes, equinox modules): a Llama written as levanter writes its models.

Grouped-query heads as ``kv_heads x q_heads_per_group`` axes, rotary embeddings in
haliax operations, ``hnn.RmsNorm``, a SwiGLU MLP, layers in ``hnn.Stacked`` (a scan),
tied embeddings (``Embedding.unembed``); the loss is ``hnn.cross_entropy_loss`` on
one-hot targets.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp

from . import Model, Size, counts


class _Axes:
    def __init__(self, size: Size):
        self.batch = hax.Axis("batch", size.batch)
        self.pos = hax.Axis("position", size.seq)
        self.kpos = self.pos.alias("key_position")
        self.embed = hax.Axis("embed", size.width)
        self.kv_heads = hax.Axis("kv_heads", size.kv_heads)
        self.group = hax.Axis("q_heads_per_group", size.heads // size.kv_heads)
        self.head = hax.Axis("head_size", size.head_dim)
        self.mlp = hax.Axis("mlp", size.ffn)
        self.vocab = hax.Axis("vocab", size.vocab)
        self.layers = hax.Axis("layers", size.layers)


def _rotate_half(x, head):
    half = head.size // 2
    return hax.concatenate(head, (-x[head, half:], x[head, :half]))


def _rotary(q, k, ax: _Axes, theta: float = 10000.0):
    half = ax.head.resize(ax.head.size // 2)
    inv_freq = 1.0 / (theta ** (hax.arange(half) * 2.0 / ax.head.size))
    freqs = hax.arange(ax.pos).astype(jnp.float32) * inv_freq.broadcast_axis(ax.pos)
    emb = hax.concatenate(ax.head, (freqs.rename({half.name: ax.head.name}),) * 2)
    cos, sin = hax.cos(emb), hax.sin(emb)
    return (
        q * cos + _rotate_half(q, ax.head) * sin,
        k * cos + _rotate_half(k, ax.head) * sin,
    )


class Attention(eqx.Module):
    q_proj: hnn.Linear
    k_proj: hnn.Linear
    v_proj: hnn.Linear
    o_proj: hnn.Linear
    ax: _Axes = eqx.field(static=True)

    @staticmethod
    def init(ax: _Axes, *, key):
        kq, kk, kv, ko = jax.random.split(key, 4)
        q_axes = (ax.kv_heads, ax.group, ax.head)
        return Attention(
            hnn.Linear.init(ax.embed, q_axes, key=kq, use_bias=False),
            hnn.Linear.init(ax.embed, (ax.kv_heads, ax.head), key=kk, use_bias=False),
            hnn.Linear.init(ax.embed, (ax.kv_heads, ax.head), key=kv, use_bias=False),
            hnn.Linear.init(q_axes, ax.embed, key=ko, use_bias=False),
            ax,
        )

    def __call__(self, x, mask):
        q, k = _rotary(self.q_proj(x), self.k_proj(x), self.ax)
        k = k.rename({"position": "key_position"})
        v = self.v_proj(x).rename({"position": "key_position"})
        out = hnn.attention.dot_product_attention(self.ax.kpos, self.ax.head, q, k, v, mask=mask)
        return self.o_proj(out)


class Mlp(eqx.Module):
    gate_proj: hnn.Linear
    up_proj: hnn.Linear
    down_proj: hnn.Linear

    @staticmethod
    def init(ax: _Axes, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        return Mlp(
            hnn.Linear.init(ax.embed, ax.mlp, key=k1, use_bias=False),
            hnn.Linear.init(ax.embed, ax.mlp, key=k2, use_bias=False),
            hnn.Linear.init(ax.mlp, ax.embed, key=k3, use_bias=False),
        )

    def __call__(self, x):
        return self.down_proj(hnn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(eqx.Module):
    self_attn: Attention
    mlp: Mlp
    input_layernorm: hnn.RmsNorm
    post_attention_layernorm: hnn.RmsNorm

    @staticmethod
    def init(ax: _Axes, *, key):
        k1, k2 = jax.random.split(key)
        return DecoderLayer(
            Attention.init(ax, key=k1),
            Mlp.init(ax, key=k2),
            hnn.RmsNorm.init(ax.embed, eps=1e-6, use_bias=False),
            hnn.RmsNorm.init(ax.embed, eps=1e-6, use_bias=False),
        )

    def __call__(self, x, mask):
        x = x + self.self_attn(self.input_layernorm(x), mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaLM(eqx.Module):
    embeddings: hnn.Embedding
    layers: hnn.Stacked
    norm: hnn.RmsNorm

    @staticmethod
    def init(ax: _Axes, *, key):
        ke, kl = jax.random.split(key)
        layers = hnn.Stacked.init(ax.layers, DecoderLayer)(
            ax, key=jax.random.split(kl, ax.layers.size)
        )
        norm = hnn.RmsNorm.init(ax.embed, eps=1e-6, use_bias=False)
        return LlamaLM(hnn.Embedding.init(ax.vocab, ax.embed, key=ke), layers, norm)

    def __call__(self, input_ids, mask):
        x = self.layers.fold(self.embeddings.embed(input_ids), mask=mask)
        return self.embeddings.unembed(self.norm(x))


def llama(size: Size, seed: int = 0):
    ax = _Axes(size)
    model = LlamaLM.init(ax, key=jax.random.key(seed))
    params, static = eqx.partition(model, eqx.is_array)
    key = jax.random.key(seed + 1)
    batch = {"tokens": jax.random.randint(key, (size.batch, size.seq + 1), 0, size.vocab)}

    def loss(params, batch):
        m = eqx.combine(params, static)
        tokens = batch["tokens"]
        inputs = hax.named(tokens[:, :-1], (ax.batch, ax.pos))
        targets = hax.named(tokens[:, 1:], (ax.batch, ax.pos))
        logits = m(inputs, hnn.attention.causal_mask(ax.pos, ax.kpos))
        one_hot = hax.nn.one_hot(targets, ax.vocab)
        return hnn.cross_entropy_loss(logits, ax.vocab, one_hot, reduction=hax.mean).scalar()

    return params, batch, loss


MODELS = (
    Model(
        "haliax-llama",
        "haliax",
        ("GQA", "RoPE", "SwiGLU", "RMS norm", "tied embeddings", "named axes", "scanned layers"),
        llama,
        counts,
    ),
)
