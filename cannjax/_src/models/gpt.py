"""A GPT-style decoder, written twice with the same parameters: with cannjax operators
and in plain JAX (``jax.nn``), so outputs, gradients, time and memory can be compared.

Shape letters: ``B`` batch, ``T`` sequence length, ``D`` width, ``N`` heads, ``H = D / N``
head dim, ``V`` vocabulary, ``L`` layers.

Each block is pre-norm: ``x += W_o attn(ln1(x))``, ``x += W_2 gelu(W_1 ln2(x))``. Layers
run under ``lax.scan`` over stacked weights (the idiom of deep JAX models), where a
residual saved per layer is stacked ``L`` times: this is where hand-written backward
rules pay most. The cannjax model also recomputes ``gelu`` and both layer norms in the
backward (``models/recompute.py``), so each layer saves its MLP's hidden ``W_1 ln2(x)``
once and neither norm's output: the projections after a norm save the residual stream ``x``,
which the norm's backward keeps anyway.

Example:
  >>> import jax, cannjax
  >>> cfg = cannjax.models.GPTConfig(vocab=32, width=32, heads=2, layers=2, seq_len=8)
  >>> params = cannjax.models.init_gpt(jax.random.key(0), cfg)
  >>> tokens = jax.numpy.zeros((2, 8), jax.numpy.int32)
  >>> cannjax.models.gpt_loss(params, tokens, tokens, cfg).shape
  ()
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from cannjax import ops
from cannjax._src.core.partitioned import placed_like
from cannjax._src.models.compute import (
    check_dtype,
    check_unroll,
    in_compute_dtype,
    layer_unroll,
    loss_dtype,
)
from cannjax._src.models.recompute import recomputed


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model sizes and options (hashable: usable as a static argument).

    Attributes:
      vocab: vocabulary size ``V``.
      width: model width ``D``.
      heads: attention heads ``N`` (must divide ``width``).
      layers: number of blocks ``L``.
      seq_len: maximum sequence length ``T``.
      mlp_ratio: hidden width of the MLP as a multiple of ``D``.
      remat: how the cannjax model checkpoints its layers: ``"none"`` or ``"layer"``
        (recompute each block's activations in the backward; keeps only the carry).
      dtype: the compute dtype (``"bfloat16"`` for mixed precision): the parameters are
        cast to it inside the loss and the loss returned in float32
        (:mod:`cannjax._src.models.compute`); None computes in the parameters' dtype.
      unroll: layers per iteration of the layer scan (``lax.scan``'s ``unroll``); None
        chooses per platform: every layer in half precision on a platform that writes
        stacked half arrays through float32 (XLA:CPU), else 1
        (:func:`cannjax._src.models.compute.layer_unroll`).
    """

    vocab: int = 1024
    width: int = 256
    heads: int = 4
    layers: int = 4
    seq_len: int = 256
    mlp_ratio: int = 4
    remat: str = "none"
    dtype: str | None = None
    unroll: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", check_dtype("cannjax.models.GPTConfig", self.dtype))
        object.__setattr__(self, "unroll", check_unroll("cannjax.models.GPTConfig", self.unroll))
        for f in ("vocab", "width", "heads", "layers", "seq_len", "mlp_ratio"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"cannjax.models.GPTConfig: {f} must be a positive int, got {v!r}")
        if self.width % self.heads:
            raise ValueError(
                f"cannjax.models.GPTConfig: heads={self.heads} must divide width={self.width}"
            )
        if self.remat not in ("none", "layer"):
            raise ValueError(
                f"cannjax.models.GPTConfig: remat must be 'none' or 'layer', got {self.remat!r}"
            )


class Blocks(NamedTuple):
    """Per-layer weights, each stacked along a leading axis of size ``L``."""

    ln1_scale: jax.Array  # [L, D]
    ln1_bias: jax.Array  # [L, D]
    w_qkv: jax.Array  # [L, D, 3D]
    w_o: jax.Array  # [L, D, D]
    ln2_scale: jax.Array  # [L, D]
    ln2_bias: jax.Array  # [L, D]
    w_1: jax.Array  # [L, D, rD]
    b_1: jax.Array  # [L, rD]
    w_2: jax.Array  # [L, rD, D]


class GPTParams(NamedTuple):
    """All weights of the model."""

    embed: jax.Array  # [V, D]
    pos: jax.Array  # [T, D]
    blocks: Blocks
    lnf_scale: jax.Array  # [D]
    lnf_bias: jax.Array  # [D]
    head: jax.Array  # [D, V]


def init_gpt(key: jax.Array, cfg: GPTConfig, dtype: Any = jnp.float32) -> GPTParams:
    """Initializes weights (normal, std 0.02; output projections scaled by 1/sqrt(2L))."""
    d, r, n_layers = cfg.width, cfg.mlp_ratio * cfg.width, cfg.layers
    ks = iter(jax.random.split(key, 8))

    def normal(shape, std=0.02):
        return (std * jax.random.normal(next(ks), shape)).astype(dtype)

    proj_std = 0.02 / (2 * n_layers) ** 0.5
    blocks = Blocks(
        ln1_scale=jnp.ones((n_layers, d), dtype),
        ln1_bias=jnp.zeros((n_layers, d), dtype),
        w_qkv=normal((n_layers, d, 3 * d)),
        w_o=normal((n_layers, d, d), proj_std),
        ln2_scale=jnp.ones((n_layers, d), dtype),
        ln2_bias=jnp.zeros((n_layers, d), dtype),
        w_1=normal((n_layers, d, r)),
        b_1=jnp.zeros((n_layers, r), dtype),
        w_2=normal((n_layers, r, d), proj_std),
    )
    return GPTParams(
        embed=normal((cfg.vocab, d)),
        pos=normal((cfg.seq_len, d)),
        blocks=blocks,
        lnf_scale=jnp.ones((d,), dtype),
        lnf_bias=jnp.zeros((d,), dtype),
        head=normal((d, cfg.vocab)),
    )


class _Ops(NamedTuple):
    linear: Callable[..., jax.Array]
    layer_norm: Callable[..., jax.Array]
    gelu: Callable[..., jax.Array]
    attention: Callable[..., jax.Array]
    cross_entropy: Callable[..., jax.Array]  # per token
    mean_cross_entropy: Callable[..., jax.Array]
    recompute_activation: bool = False  # see recompute.recomputed
    recompute_norm: bool = False
    place_carry: bool = False  # the layer loop's result placed as its input is


def _lead(v, x):
    # Explicit rank: the test suite runs with jax_numpy_rank_promotion="raise".
    return v.reshape((1,) * (x.ndim - v.ndim) + v.shape)


def _plain_layer_norm(x, scale, bias, eps=1e-5):
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean(jnp.square(x - m), -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + eps) * _lead(scale, x) + _lead(bias, x)


def _plain_linear(x, w, b=None):
    y = x @ w
    return y if b is None else y + _lead(b, y)


_PLAIN = _Ops(
    linear=_plain_linear,
    layer_norm=_plain_layer_norm,
    gelu=jax.nn.gelu,
    attention=lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
    cross_entropy=lambda x, w, labels: optax.softmax_cross_entropy_with_integer_labels(
        x @ w, labels
    ),
    mean_cross_entropy=lambda x, w, labels: jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(x @ w, labels)
    ),
)


def _cannjax_ops() -> _Ops:
    return _Ops(
        linear=ops.linear,
        layer_norm=ops.layer_norm,
        gelu=ops.gelu,
        attention=functools.partial(ops.attention, causal=True),
        # Every token counts, as in the plain twin's jnp.mean (weights mask tokens): the
        # mean's divisor is known at trace time, not a count reduced across devices.
        cross_entropy=functools.partial(ops.linear_cross_entropy, ignore_index=None),
        mean_cross_entropy=functools.partial(
            ops.linear_cross_entropy, reduction="mean", ignore_index=None
        ),
        recompute_activation=True,
        recompute_norm=True,
        place_carry=True,
    )


def _block(o: _Ops, cfg: GPTConfig, x: jax.Array, p: Blocks) -> jax.Array:
    b, t, d = x.shape
    n, h = cfg.heads, d // cfg.heads

    def normed(x, scale, bias, w, c=None):
        return o.linear(o.layer_norm(x, scale, bias), w, c)

    norm_linear = recomputed(normed, o.recompute_norm)
    qkv = norm_linear(x, p.ln1_scale, p.ln1_bias, p.w_qkv)
    q, k, v = (z.reshape(b, t, n, h) for z in jnp.split(qkv, 3, axis=-1))
    x = x + o.linear(o.attention(q, k, v).reshape(b, t, d), p.w_o)
    hidden = norm_linear(x, p.ln2_scale, p.ln2_bias, p.w_1, p.b_1)
    mlp_down = recomputed(lambda h, w: o.linear(o.gelu(h), w), o.recompute_activation)
    return x + mlp_down(hidden, p.w_2)


def _features(o: _Ops, params: GPTParams, tokens: jax.Array, cfg: GPTConfig) -> jax.Array:
    t = tokens.shape[-1]
    try:
        too_long = t > cfg.seq_len
    except jax.errors.InconclusiveDimensionOperation:
        raise ValueError(
            f"cannjax.models: the symbolic length {t} of tokens must be bounded by the "
            f"model's seq_len={cfg.seq_len}: export with the constraint "
            f"'{t} <= {cfg.seq_len}' (jax.export.symbolic_shape(..., constraints=[...]))"
        ) from None
    if too_long:
        raise ValueError(
            f"cannjax.models: tokens of length {t} exceed the model's seq_len={cfg.seq_len}"
        )
    x = params.embed[tokens] + params.pos[None, :t]
    body = functools.partial(_block, o, cfg)
    if cfg.remat == "layer":
        body = jax.checkpoint(body)
    unroll = layer_unroll(cfg.unroll, cfg.layers, x.dtype)
    y, _ = jax.lax.scan(lambda c, p: (body(c, p), None), x, params.blocks, unroll=unroll)
    x = placed_like(y, x) if o.place_carry else y
    return o.layer_norm(x, params.lnf_scale, params.lnf_bias)


def gpt_logits(params: GPTParams, tokens: jax.Array, cfg: GPTConfig) -> jax.Array:
    """Logits ``[B, T, V]`` of the cannjax model for ``tokens`` ``[B, T]``."""
    o, params = _cannjax_ops(), in_compute_dtype(params, cfg.dtype)
    return o.linear(_features(o, params, tokens, cfg), params.head)


def plain_gpt_logits(params: GPTParams, tokens: jax.Array, cfg: GPTConfig) -> jax.Array:
    """Logits of the same model in plain JAX."""
    params = in_compute_dtype(params, cfg.dtype)
    return _PLAIN.linear(_features(_PLAIN, params, tokens, cfg), params.head)


def _loss(o, params, tokens, targets, cfg, weights):
    return loss_dtype(
        _loss_in(o, in_compute_dtype(params, cfg.dtype), tokens, targets, cfg, weights)
    )


def _loss_in(o, params, tokens, targets, cfg, weights):
    x = _features(o, params, tokens, cfg)
    x, targets = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
    if weights is None:
        return o.mean_cross_entropy(x, params.head, targets)
    losses = o.cross_entropy(x, params.head, targets)
    w = weights.reshape(-1).astype(losses.dtype)
    return jnp.sum(losses * w) / jnp.maximum(jnp.sum(w), 1)


def gpt_loss(params, tokens, targets, cfg: GPTConfig, weights=None) -> jax.Array:
    """Mean next-token cross-entropy of the cannjax model (optionally weighted per token)."""
    return _loss(_cannjax_ops(), params, tokens, targets, cfg, weights)


def plain_gpt_loss(params, tokens, targets, cfg: GPTConfig, weights=None) -> jax.Array:
    """The same loss in plain JAX."""
    return _loss(_PLAIN, params, tokens, targets, cfg, weights)
