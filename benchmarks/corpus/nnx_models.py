"""flax.nnx: a GPT from nnx's own layers, as the miniGPT tutorial writes one.

``nnx.MultiHeadAttention`` with grouped-query heads (it calls
``jax.nn.dot_product_attention``), ``nnx.LayerNorm``, a GELU MLP of ``nnx.Linear``, learned
positions and the embedding tied to the head (``Embed.attend``); the loss is
``optax.softmax_cross_entropy_with_integer_labels`` through ``nnx.split`` / ``nnx.merge``.
In mixed precision every layer takes nnx's ``dtype=`` (its computation's dtype; the
parameters stay in the default ``param_dtype=float32``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from . import Model, Size, counts


class Block(nnx.Module):
    def __init__(self, size: Size, rngs: nnx.Rngs, dtype=None):
        d = size.width
        self.ln1 = nnx.LayerNorm(d, epsilon=1e-6, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=size.heads,
            num_kv_heads=size.kv_heads,
            in_features=d,
            qkv_features=d,
            use_bias=False,
            decode=False,
            dtype=dtype,
            rngs=rngs,
        )
        self.ln2 = nnx.LayerNorm(d, epsilon=1e-6, dtype=dtype, rngs=rngs)
        self.fc1 = nnx.Linear(d, size.ffn, dtype=dtype, rngs=rngs)
        self.fc2 = nnx.Linear(size.ffn, d, dtype=dtype, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


class MiniGPT(nnx.Module):
    def __init__(self, size: Size, rngs: nnx.Rngs, dtype=None):
        self.tok = nnx.Embed(size.vocab, size.width, dtype=dtype, rngs=rngs)
        self.pos = nnx.Embed(size.seq, size.width, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(size, rngs, dtype) for _ in range(size.layers)])
        self.ln_f = nnx.LayerNorm(size.width, epsilon=1e-6, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        x = self.tok(tokens) + self.pos(jnp.arange(tokens.shape[1])[None])
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.tok.attend(self.ln_f(x))


def gpt(size: Size, seed: int = 0, compute=None):
    graphdef, params = nnx.split(MiniGPT(size, nnx.Rngs(seed), compute))
    key = jax.random.key(seed + 1)
    batch = {"tokens": jax.random.randint(key, (size.batch, size.seq + 1), 0, size.vocab)}

    def loss(params, batch):
        model = nnx.merge(graphdef, params)
        logits = model(batch["tokens"][:, :-1])
        labels = batch["tokens"][:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return params, batch, loss


# q, k, v, out and the MLP's two: 6 projections per layer.
MODELS = (
    Model(
        "nnx-gpt",
        "flax",
        ("GQA", "layer norm", "GELU", "tied embeddings"),
        gpt,
        lambda size: counts(size, dense_per_layer=6, rope=False),
        "every layer's dtype=jnp.bfloat16",
    ),
)
