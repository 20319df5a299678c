"""dm-haiku: a GPT from haiku's own modules and a Llama-style decoder written in haiku.

``haiku-gpt``: ``hk.MultiHeadAttention`` with a causal mask, ``hk.LayerNorm``, a GELU MLP
of ``hk.Linear``, learned positions, ``optax.softmax_cross_entropy_with_integer_labels``
(as haiku's transformer example writes it). ``haiku-llama``: ``hk.RMSNorm``, rotary
embeddings by halves, grouped-query heads repeated with ``jnp.repeat``, a SwiGLU MLP of
``hk.Linear(with_bias=False)``, the loss as ``-take_along_axis(log_softmax)``.

In mixed precision the models take haiku's own policies (``hk.mixed_precision``, with
jmp), as haiku's ImageNet example sets them: ``params=float32,compute=bfloat16,
output=float32`` on the model and the norms computed in float32 (``compute=float32,
output=bfloat16``). The policies are pushed while the loss is traced, so that the float32
model built beside it is left as it is.
"""

from __future__ import annotations

import contextlib

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

from . import Model, Size, counts, tokens


class GPT(hk.Module):
    def __init__(self, size: Size, name=None):
        super().__init__(name=name)
        self.size = size

    def __call__(self, tokens):
        size = self.size
        d, t = size.width, tokens.shape[1]
        x = (
            hk.Embed(size.vocab, d)(tokens)
            + hk.get_parameter(
                "positions", [size.seq, d], init=hk.initializers.TruncatedNormal(0.02)
            )[:t]
        )
        mask = jnp.tril(jnp.ones((1, 1, t, t), bool))
        for _ in range(size.layers):
            h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
            attn = hk.MultiHeadAttention(
                num_heads=size.heads,
                key_size=size.head_dim,
                w_init=hk.initializers.VarianceScaling(1.0),
            )
            x = x + attn(h, h, h, mask=mask)
            h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
            h = hk.Linear(size.ffn)(h)
            x = x + hk.Linear(d)(jax.nn.gelu(h))
        x = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
        return hk.Linear(size.vocab)(x)


def _policies(model, compute):
    """The context in which ``model`` computes in ``compute`` (None: as written)."""
    stack = contextlib.ExitStack()
    if compute is not None:
        name = jnp.dtype(compute).name
        push = hk.mixed_precision.push_policy
        stack.enter_context(push(model, jmp.get_policy(f"p=f32,c={name},o=f32")))
        for norm in (hk.LayerNorm, hk.RMSNorm):
            stack.enter_context(push(norm, jmp.get_policy(f"p=f32,c=f32,o={name}")))
    return stack


def gpt(size: Size, seed: int = 0, compute=None):
    f = hk.without_apply_rng(hk.transform(lambda tokens: GPT(size)(tokens)))
    batch = tokens(size, seed)
    params = f.init(jax.random.key(seed), batch["tokens"][:, :-1])

    def loss(params, batch):
        with _policies(GPT, compute):
            logits = f.apply(params, batch["tokens"][:, :-1])
        labels = batch["tokens"][:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return params, batch, loss


def _rope(x, positions, base=10000.0):
    """x [B, T, H, D] rotated by halves."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (np.arange(0, d, 2) / d))
    angles = positions[:, None] * inv[None, :]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class LlamaAttention(hk.Module):
    def __init__(self, size: Size, name=None):
        super().__init__(name=name)
        self.size = size

    def __call__(self, x):
        s = self.size
        b, t, _ = x.shape
        q = hk.Linear(s.heads * s.head_dim, with_bias=False, name="q")(x)
        k = hk.Linear(s.kv_heads * s.head_dim, with_bias=False, name="k")(x)
        v = hk.Linear(s.kv_heads * s.head_dim, with_bias=False, name="v")(x)
        q = q.reshape(b, t, s.heads, s.head_dim)
        k = k.reshape(b, t, s.kv_heads, s.head_dim)
        v = v.reshape(b, t, s.kv_heads, s.head_dim)
        pos = jnp.arange(t, dtype=jnp.float32)
        q, k = _rope(q, pos), _rope(k, pos)
        groups = s.heads // s.kv_heads
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        logits = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(s.head_dim)
        causal = jnp.tril(jnp.ones((t, t), bool))
        logits = jnp.where(causal[None, None], logits, jnp.finfo(logits.dtype).min)
        weights = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bhts,bshd->bthd", weights, v).reshape(b, t, -1)
        return hk.Linear(s.width, with_bias=False, name="o")(out)


class Llama(hk.Module):
    def __init__(self, size: Size, name=None):
        super().__init__(name=name)
        self.size = size

    def __call__(self, tokens):
        size = self.size
        x = hk.Embed(size.vocab, size.width)(tokens)
        for _ in range(size.layers):
            x = x + LlamaAttention(size)(hk.RMSNorm(-1, eps=1e-6)(x))
            h = hk.RMSNorm(-1, eps=1e-6)(x)
            gate = hk.Linear(size.ffn, with_bias=False, name="gate")(h)
            up = hk.Linear(size.ffn, with_bias=False, name="up")(h)
            x = x + hk.Linear(size.width, with_bias=False, name="down")(jax.nn.silu(gate) * up)
        return hk.Linear(size.vocab, with_bias=False)(hk.RMSNorm(-1, eps=1e-6)(x))


def llama(size: Size, seed: int = 0, compute=None):
    f = hk.without_apply_rng(hk.transform(lambda tokens: Llama(size)(tokens)))
    batch = tokens(size, seed)
    params = f.init(jax.random.key(seed), batch["tokens"][:, :-1])

    def loss(params, batch):
        with _policies(Llama, compute):
            logits = f.apply(params, batch["tokens"][:, :-1])
        labels = batch["tokens"][:, 1:]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()

    return params, batch, loss


HALF_SETTING = "hk.mixed_precision policies (jmp), the norms in float32"

MODELS = (
    Model(
        "haiku-gpt",
        "dm-haiku",
        ("hk.MultiHeadAttention", "layer norm", "GELU"),
        gpt,
        lambda size: counts(size, dense_per_layer=6, rope=False),
        HALF_SETTING,
    ),
    Model(
        "haiku-llama",
        "dm-haiku",
        ("GQA by jnp.repeat", "RMS norm", "RoPE", "SwiGLU"),
        llama,
        lambda size: counts(size, dense_per_layer=7),
        HALF_SETTING,
    ),
)
