"""Models written the way flax, equinox and plain-JAX users write them (no cannjax inside).

These are what :func:`cannjax.optimize` is judged on (``benchmarks/optimize.py``,
``tests/test_optimize_models.py``). Shapes follow ``benchmarks/gpt.py``: a decoder-only
transformer with pre-norm blocks, ``x += attn(ln1(x))``, ``x += W2 gelu(W1 ln2(x))``,
causal self-attention, a final layer norm and an untied head, trained with optax's
integer-label cross-entropy.

* :class:`NnxGPT`: flax.nnx (``nnx.Embed``, ``nnx.MultiHeadAttention``, ``nnx.LayerNorm``,
  ``nnx.Linear``, ``jax.nn.gelu``); layers in a Python list, or stacked under ``nnx.scan``
  (``scan=True``).
* :class:`EqxGPT`: equinox (``eqx.nn.MultiheadAttention``, ``eqx.nn.LayerNorm``,
  ``eqx.nn.Linear``, all applied per token under ``jax.vmap``, as equinox documents).
* :func:`init_mlp` / :func:`mlp_loss`: a plain ``jnp`` MLP classifier.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Shape:
    """Model sizes (``benchmarks/gpt.py``'s GPT shape by default)."""

    vocab: int = 1024
    width: int = 256
    heads: int = 4
    layers: int = 4
    seq_len: int = 256
    batch: int = 8
    # flax.nnx's compute dtype (``dtype=`` of every layer; parameters stay float32,
    # ``param_dtype``'s default): ``jnp.bfloat16`` for a mixed-precision model.
    dtype: object = None


# ---------------------------------------------------------------------------- flax.nnx
class NnxBlock(nnx.Module):
    def __init__(self, s: Shape, *, rngs: nnx.Rngs):
        dt = s.dtype
        self.ln1 = nnx.LayerNorm(s.width, dtype=dt, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=s.heads, in_features=s.width, decode=False, dtype=dt, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(s.width, dtype=dt, rngs=rngs)
        self.fc1 = nnx.Linear(s.width, 4 * s.width, dtype=dt, rngs=rngs)
        self.fc2 = nnx.Linear(4 * s.width, s.width, dtype=dt, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))


class NnxGPT(nnx.Module):
    def __init__(self, s: Shape, *, scan: bool = False, rngs: nnx.Rngs):
        self.scan = scan
        self.embed = nnx.Embed(s.vocab, s.width, dtype=s.dtype, rngs=rngs)
        self.pos = nnx.Embed(s.seq_len, s.width, dtype=s.dtype, rngs=rngs)
        if scan:

            @nnx.split_rngs(splits=s.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return NnxBlock(s, rngs=rngs)

            self.blocks = make(rngs)
        else:
            self.blocks = nnx.List([NnxBlock(s, rngs=rngs) for _ in range(s.layers)])
        self.ln_f = nnx.LayerNorm(s.width, dtype=s.dtype, rngs=rngs)
        self.head = nnx.Linear(s.width, s.vocab, use_bias=False, dtype=s.dtype, rngs=rngs)

    def __call__(self, tokens):
        t = tokens.shape[-1]
        x = self.embed(tokens) + self.pos(jnp.arange(t))
        mask = nnx.make_causal_mask(tokens)
        if self.scan:

            @nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
            def run(x, block, mask):
                return block(x, mask)

            x = run(x, self.blocks, mask)
        else:
            for block in self.blocks:
                x = block(x, mask)
        return self.head(self.ln_f(x))


def nnx_loss(model: NnxGPT, tokens, targets):
    logits = model(tokens)
    # A bfloat16 model's logits go to the loss in float32, as flax's examples do.
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# ---------------------------------------------------------------------------- equinox
class EqxBlock(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, s: Shape, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1 = eqx.nn.LayerNorm(s.width)
        self.attn = eqx.nn.MultiheadAttention(s.heads, s.width, key=k1)
        self.ln2 = eqx.nn.LayerNorm(s.width)
        self.fc1 = eqx.nn.Linear(s.width, 4 * s.width, key=k2)
        self.fc2 = eqx.nn.Linear(4 * s.width, s.width, key=k3)

    def __call__(self, x, mask):  # x: [T, D], one sequence
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=mask)
        h = jax.vmap(self.fc1)(jax.vmap(self.ln2)(x))
        return x + jax.vmap(self.fc2)(jax.nn.gelu(h))


class EqxGPT(eqx.Module):
    embed: eqx.nn.Embedding
    pos: eqx.nn.Embedding
    blocks: list
    ln_f: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, s: Shape, key):
        ks = jax.random.split(key, s.layers + 3)
        self.embed = eqx.nn.Embedding(s.vocab, s.width, key=ks[0])
        self.pos = eqx.nn.Embedding(s.seq_len, s.width, key=ks[1])
        self.blocks = [EqxBlock(s, k) for k in ks[3:]]
        self.ln_f = eqx.nn.LayerNorm(s.width)
        self.head = eqx.nn.Linear(s.width, s.vocab, use_bias=False, key=ks[2])

    def __call__(self, tokens):  # tokens: [T]
        t = tokens.shape[0]
        x = jax.vmap(self.embed)(tokens) + jax.vmap(self.pos)(jnp.arange(t))
        mask = jnp.tril(jnp.ones((t, t), bool))
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(self.head)(jax.vmap(self.ln_f)(x))


def eqx_loss(model: EqxGPT, tokens, targets):
    logits = jax.vmap(model)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# ---------------------------------------------------------------------------- plain jnp
def init_mlp(key, sizes=(784, 512, 512, 10)):
    params = []
    for k, (m, n) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:])):
        params.append({"w": jax.random.normal(k, (m, n)) / jnp.sqrt(m), "b": jnp.zeros(n)})
    return params


def mlp_loss(params, x, labels):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def batch(s: Shape, key=None):
    """Random tokens and next-token targets ``[B, T]``."""
    key = jax.random.key(1) if key is None else key
    toks = jax.random.randint(key, (s.batch, s.seq_len + 1), 0, s.vocab)
    return toks[:, :-1], toks[:, 1:]
