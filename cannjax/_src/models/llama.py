"""A Llama-style decoder, written twice with the same parameters: with cannjax operators
and in plain JAX, so outputs, gradients, time and memory can be compared.

Shape letters: ``B`` batch, ``T`` sequence length, ``D`` width, ``N`` query heads, ``K``
key/value heads (``K`` divides ``N``: grouped-query attention), ``H = D / N`` head dim,
``F`` hidden width of the MLP, ``V`` vocabulary, ``L`` layers.

Each block is pre-norm with RMS norm, rotary position embeddings on the queries and keys
(half-split layout, as Hugging Face's Llama), grouped-query causal attention and a
SwiGLU MLP::

  a = rms_norm(x);  q, k, v = a W_q, a W_k, a W_v      (N, K, K heads of size H)
  x += W_o attn(rope(q), rope(k), v)
  a = rms_norm(x);  x += W_down (silu(a W_gate) * (a W_up))

then a final RMS norm and the head (``embed^T`` when the embeddings are tied). There is
no positional embedding table and no bias anywhere. Layers run under ``lax.scan`` over
stacked weights.

The cannjax model calls ``ops.rms_norm``, ``ops.rope``, ``ops.attention`` (k and v keep
their ``K`` heads: never repeated), ``ops.swiglu``, ``ops.linear`` and
``ops.linear_cross_entropy`` (the ``[B T, V]`` logits are never held), and runs each RMS
norm together with the projections that read it under ``jax.checkpoint``, so the norm's
output is recomputed in the backward rather than saved (``models/recompute.py``). The plain twin is
written as a user writes it: ``jnp`` RMS norm, RoPE with ``rotate_half``, ``jnp.repeat``
of k and v into ``jax.nn.dot_product_attention``, a ``jax.nn.silu`` MLP and optax's
cross-entropy on the full logits.

Example:
  >>> import jax, cannjax.models
  >>> cfg = cannjax.models.LlamaConfig(
  ...     vocab=32, width=32, heads=4, kv_heads=2, layers=2, seq_len=8, hidden=64)
  >>> params = cannjax.models.init_llama(jax.random.key(0), cfg)
  >>> params.blocks.w_qkv.shape  # [L, D, (N + 2K) H]: q, k and v columns side by side
  (2, 32, 64)
  >>> params.head is None  # tied: the head is embed^T
  True
  >>> tokens = jax.numpy.zeros((2, 8), jax.numpy.int32)
  >>> cannjax.models.llama_loss(params, tokens, tokens, cfg).shape
  ()

References:
  Touvron et al., "LLaMA: Open and Efficient Foundation Language Models", 2023.
  https://arxiv.org/abs/2302.13971
  Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models from
  Multi-Head Checkpoints", 2023. https://arxiv.org/abs/2305.13245
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
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

_CFG = "cannjax.models.LlamaConfig"


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Model sizes and options (hashable: usable as a static argument).

    Attributes:
      vocab: vocabulary size ``V``.
      width: model width ``D``.
      heads: query heads ``N`` (must divide ``width``; the head dim ``H = D / N`` must be
        even, for the rotary embedding's pairs).
      kv_heads: key/value heads ``K`` (must divide ``heads``; ``K < N`` is grouped-query
        attention, ``K = 1`` multi-query).
      layers: number of blocks ``L``.
      seq_len: maximum sequence length ``T``.
      hidden: hidden width ``F`` of the SwiGLU MLP (Llama: about ``8 D / 3``, rounded up
        to a multiple of 32 or more).
      rope_theta: base of the rotary embedding's frequencies (positive).
      norm_eps: ``eps`` of every RMS norm (positive).
      tie_embeddings: the head is ``embed^T`` (True) or a separate ``[D, V]`` weight.
      remat: how the cannjax model checkpoints its layers: ``"none"`` or ``"layer"``
        (recompute each block's activations in the backward; keeps only the carry).
      dtype: the compute dtype (``"bfloat16"`` for mixed precision): the parameters are
        cast to it inside the loss and the loss returned in float32
        (:mod:`cannjax._src.models.compute`); None computes in the parameters' dtype.
      unroll: layers per iteration of the layer scan (``lax.scan``'s ``unroll``); None
        chooses per platform: every layer in half precision on a platform that writes
        stacked half arrays through float32 (XLA:CPU), else 1
        (:func:`cannjax._src.models.compute.layer_unroll`).

    Raises:
      ValueError: a size that is not a positive int, ``heads`` not dividing ``width``,
        ``kv_heads`` not dividing ``heads``, an odd head dim, a non-positive
        ``rope_theta`` or ``norm_eps``, or an unknown ``remat``.
      TypeError: ``tie_embeddings`` not a bool.
    """

    vocab: int
    width: int
    heads: int
    kv_heads: int
    layers: int
    seq_len: int
    hidden: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    remat: str = "none"
    dtype: str | None = None
    unroll: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", check_dtype(_CFG, self.dtype))
        object.__setattr__(self, "unroll", check_unroll(_CFG, self.unroll))
        for f in ("vocab", "width", "heads", "kv_heads", "layers", "seq_len", "hidden"):
            v = getattr(self, f)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{_CFG}: {f} must be a positive int, got {v!r}")
        if self.width % self.heads:
            raise ValueError(
                f"{_CFG}: heads={self.heads} must divide width={self.width} "
                f"(the head dim is width / heads)"
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"{_CFG}: kv_heads={self.kv_heads} must divide heads={self.heads} "
                f"(each key/value head serves heads / kv_heads query heads), e.g. "
                f"kv_heads={_largest_divisor_at_most(self.heads, self.kv_heads)}"
            )
        if (self.width // self.heads) % 2:
            raise ValueError(
                f"{_CFG}: the head dim width / heads = {self.width // self.heads} must be "
                f"even (the rotary embedding rotates pairs of features); change width="
                f"{self.width} or heads={self.heads}"
            )
        for f in ("rope_theta", "norm_eps"):
            v = getattr(self, f)
            if (
                isinstance(v, (bool, np.bool_))
                or not isinstance(v, (int, float, np.integer, np.floating))
                or not math.isfinite(v)
                or v <= 0
            ):
                raise ValueError(f"{_CFG}: {f} must be a positive finite float, got {v!r}")
        if not isinstance(self.tie_embeddings, (bool, np.bool_)):
            raise TypeError(f"{_CFG}: tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        if self.remat not in ("none", "layer"):
            raise ValueError(f"{_CFG}: remat must be 'none' or 'layer', got {self.remat!r}")

    @property
    def head_dim(self) -> int:
        """``H = width / heads``."""
        return self.width // self.heads


def _largest_divisor_at_most(n: int, k: int) -> int:
    return max(d for d in range(1, min(n, k) + 1) if n % d == 0)


class LlamaBlocks(NamedTuple):
    """Per-layer weights, each stacked along a leading axis of size ``L``.

    ``w_qkv``'s columns are the query heads (``N H``), then the key heads (``K H``), then
    the value heads (``K H``), each head's ``H`` columns together.
    """

    attn_norm: jax.Array  # [L, D]
    w_qkv: jax.Array  # [L, D, (N + 2K) H]
    w_o: jax.Array  # [L, N H, D]
    mlp_norm: jax.Array  # [L, D]
    w_gate: jax.Array  # [L, D, F]
    w_up: jax.Array  # [L, D, F]
    w_down: jax.Array  # [L, F, D]


class LlamaParams(NamedTuple):
    """All weights of the model; ``head`` is None when the embeddings are tied."""

    embed: jax.Array  # [V, D]
    blocks: LlamaBlocks
    norm: jax.Array  # [D]
    head: jax.Array | None  # [D, V], or None: embed^T


def init_llama(key: jax.Array, cfg: LlamaConfig, dtype: Any = jnp.float32) -> LlamaParams:
    """Initializes weights (normal, std 0.02; output projections scaled by 1/sqrt(2L)).

    Norm scales start at 1. ``head`` is None when ``cfg.tie_embeddings``.
    """
    d, f, n_layers = cfg.width, cfg.hidden, cfg.layers
    h = cfg.head_dim
    ks = iter(jax.random.split(key, 8))

    def normal(shape, std=0.02):
        return (std * jax.random.normal(next(ks), shape)).astype(dtype)

    proj_std = 0.02 / (2 * n_layers) ** 0.5
    blocks = LlamaBlocks(
        attn_norm=jnp.ones((n_layers, d), dtype),
        w_qkv=normal((n_layers, d, (cfg.heads + 2 * cfg.kv_heads) * h)),
        w_o=normal((n_layers, cfg.heads * h, d), proj_std),
        mlp_norm=jnp.ones((n_layers, d), dtype),
        w_gate=normal((n_layers, d, f)),
        w_up=normal((n_layers, d, f)),
        w_down=normal((n_layers, f, d), proj_std),
    )
    return LlamaParams(
        embed=normal((cfg.vocab, d)),
        blocks=blocks,
        norm=jnp.ones((d,), dtype),
        head=None if cfg.tie_embeddings else normal((d, cfg.vocab)),
    )


class LlamaLoRA(NamedTuple):
    """Low-rank adapters on every projection, stacked over the layers as
    :class:`LlamaBlocks`: each field is ``(a [L, in, r], b [L, r, out])`` for the weight
    of the same name, whose projection ``x W`` becomes ``x W + scale (x a) b`` with ``W``
    frozen (:func:`cannjax.ops.lora_linear`).
    """

    w_qkv: tuple[jax.Array, jax.Array]
    w_o: tuple[jax.Array, jax.Array]
    w_gate: tuple[jax.Array, jax.Array]
    w_up: tuple[jax.Array, jax.Array]
    w_down: tuple[jax.Array, jax.Array]


def init_llama_lora(
    key: jax.Array, cfg: LlamaConfig, rank: int, dtype: Any = jnp.float32, *, b_std: float = 0.0
) -> LlamaLoRA:
    """Rank-``rank`` adapters for every projection of the model of ``cfg``.

    ``a`` is normal with std ``1 / sqrt(in)``, ``b`` zero (``b_std=0``, the usual start:
    the adapted model is the base model) or normal with std ``b_std``.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"cannjax.models.init_llama_lora: rank must be an int >= 1, got {rank!r}")
    d, f, n_layers, h = cfg.width, cfg.hidden, cfg.layers, cfg.head_dim
    shapes = {
        "w_qkv": (d, (cfg.heads + 2 * cfg.kv_heads) * h),
        "w_o": (cfg.heads * h, d),
        "w_gate": (d, f),
        "w_up": (d, f),
        "w_down": (f, d),
    }
    keys = iter(jax.random.split(key, 2 * len(shapes)))
    out = {}
    for name, (n_in, n_out) in shapes.items():
        a = jax.random.normal(next(keys), (n_layers, n_in, rank)) / math.sqrt(n_in)
        b = b_std * jax.random.normal(next(keys), (n_layers, rank, n_out))
        out[name] = (a.astype(dtype), b.astype(dtype))
    return LlamaLoRA(**out)


class _Ops(NamedTuple):
    linear: Callable[..., jax.Array]
    lora_linear: Callable[..., jax.Array]  # (x, w, a, b, scale): x w + scale (x a) b
    silu: Callable[..., jax.Array]
    rms_norm: Callable[..., jax.Array]  # (x, scale, eps)
    rope: Callable[..., jax.Array]  # (x [B, T, n, H], positions [T], theta)
    attention: Callable[..., jax.Array]  # causal, q [B, T, N, H], k and v [B, T, K, H]
    swiglu: Callable[..., jax.Array]  # (x, w_gate, w_up, w_down)
    cross_entropy: Callable[..., jax.Array]  # per token, of x @ w
    mean_cross_entropy: Callable[..., jax.Array]
    recompute_norm: bool = False  # see recompute.recomputed
    place_carry: bool = False  # the layer loop's result placed as its input is


def _lead(v, x):
    # Explicit rank: the test suite runs with jax_numpy_rank_promotion="raise".
    return v.reshape((1,) * (x.ndim - v.ndim) + v.shape)


def _plain_rms_norm(x, scale, eps):
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + eps)
    return y.astype(x.dtype) * _lead(scale, x)


def _rotate_half(x):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def _plain_rope(x, positions, theta):
    # Hugging Face Llama's layout: feature i pairs with feature i + H/2, both turned by
    # the angle positions * theta^(-2i/H).
    h = x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)  # [H/2]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]  # [1, T, 1, H]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    return x * cos + _rotate_half(x) * sin


def _plain_attention(q, k, v):
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _plain_swiglu(x, w_gate, w_up, w_down):
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


_PLAIN = _Ops(
    linear=lambda x, w: x @ w,
    # flax.nnx.LoRALinear's form: x @ kernel + x @ lora_a @ lora_b (scale 1 there).
    lora_linear=lambda x, w, a, b, scale: x @ w + scale * (x @ a @ b),
    silu=jax.nn.silu,
    rms_norm=_plain_rms_norm,
    rope=_plain_rope,
    attention=_plain_attention,
    swiglu=_plain_swiglu,
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
        lora_linear=lambda x, w, a, b, scale: ops.lora_linear(x, w, a, b, scale=scale),
        silu=ops.silu,
        rms_norm=lambda x, scale, eps: ops.rms_norm(x, scale, eps=eps),
        rope=lambda x, positions, theta: ops.rope(x, positions, theta=theta, interleaved=False),
        attention=functools.partial(ops.attention, causal=True),
        swiglu=ops.swiglu,
        # Every token counts, as in the plain twin's jnp.mean (weights mask tokens): the
        # mean's divisor is known at trace time, not a count reduced across devices.
        cross_entropy=functools.partial(ops.linear_cross_entropy, ignore_index=None),
        mean_cross_entropy=functools.partial(
            ops.linear_cross_entropy, reduction="mean", ignore_index=None
        ),
        recompute_norm=True,
        place_carry=True,
    )


def _block(o: _Ops, cfg: LlamaConfig, scale: float, x: jax.Array, layer) -> jax.Array:
    p, lora = layer  # LlamaBlocks and LlamaLoRA (or None) of one layer
    b, t, _ = x.shape
    n, kv, h = cfg.heads, cfg.kv_heads, cfg.head_dim
    positions = jnp.arange(t, dtype=jnp.int32)

    def linear(x, w, *ab):  # ab: the adapters of w, if any
        return o.lora_linear(x, w, *ab, scale) if ab else o.linear(x, w)

    def adapters(name):
        return () if lora is None else getattr(lora, name)

    project = recomputed(
        lambda x, s, w, *ab: linear(o.rms_norm(x, s, cfg.norm_eps), w, *ab), o.recompute_norm
    )
    qkv = project(x, p.attn_norm, p.w_qkv, *adapters("w_qkv"))
    q, k, v = jnp.split(qkv, [n * h, (n + kv) * h], axis=-1)
    q = o.rope(q.reshape(b, t, n, h), positions, cfg.rope_theta)
    k = o.rope(k.reshape(b, t, kv, h), positions, cfg.rope_theta)
    v = v.reshape(b, t, kv, h)
    x = x + linear(o.attention(q, k, v).reshape(b, t, n * h), p.w_o, *adapters("w_o"))
    if lora is None:
        mlp = recomputed(
            lambda x, s, *w: o.swiglu(o.rms_norm(x, s, cfg.norm_eps), *w), o.recompute_norm
        )
        return x + mlp(x, p.mlp_norm, p.w_gate, p.w_up, p.w_down)
    # With adapters the three projections are LoRA products around silu(gate) * up.
    a = o.rms_norm(x, p.mlp_norm, cfg.norm_eps)
    gated = o.silu(linear(a, p.w_gate, *lora.w_gate)) * linear(a, p.w_up, *lora.w_up)
    return x + linear(gated, p.w_down, *lora.w_down)


def _check_length(t, cfg: LlamaConfig) -> None:
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


def _check_params(params: LlamaParams, cfg: LlamaConfig) -> None:
    if cfg.tie_embeddings != (params.head is None):
        has = "no head (tied)" if params.head is None else "a separate head"
        raise ValueError(
            f"cannjax.models: the params have {has} but cfg.tie_embeddings="
            f"{cfg.tie_embeddings}; initialize them with init_llama(key, cfg)"
        )


def _features(o: _Ops, params: LlamaParams, tokens: jax.Array, cfg: LlamaConfig, lora=None,
              lora_scale=1.0) -> jax.Array:  # fmt: skip
    _check_params(params, cfg)
    _check_length(tokens.shape[-1], cfg)
    x = params.embed[tokens]
    body = functools.partial(_block, o, cfg, float(lora_scale))
    if cfg.remat == "layer":
        body = jax.checkpoint(body)
    unroll = layer_unroll(cfg.unroll, cfg.layers, x.dtype)
    y, _ = jax.lax.scan(lambda c, p: (body(c, p), None), x, (params.blocks, lora), unroll=unroll)
    x = placed_like(y, x) if o.place_carry else y
    return o.rms_norm(x, params.norm, cfg.norm_eps)


def _head(params: LlamaParams) -> jax.Array:
    return params.embed.T if params.head is None else params.head


def llama_logits(params: LlamaParams, tokens: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """Logits ``[B, T, V]`` of the cannjax model for ``tokens`` ``[B, T]``."""
    o, params = _cannjax_ops(), in_compute_dtype(params, cfg.dtype)
    return o.linear(_features(o, params, tokens, cfg), _head(params))


def plain_llama_logits(params: LlamaParams, tokens: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """Logits of the same model in plain JAX."""
    params = in_compute_dtype(params, cfg.dtype)
    return _PLAIN.linear(_features(_PLAIN, params, tokens, cfg), _head(params))


def llama_head(params: LlamaParams) -> jax.Array:
    """The head ``[D, V]``: ``embed^T`` when the embeddings are tied."""
    return _head(params)


def llama_hidden(params: LlamaParams, tokens: jax.Array, cfg: LlamaConfig, *,
                 lora: LlamaLoRA | None = None, lora_scale: float = 1.0) -> jax.Array:  # fmt: skip
    """The features ``[B, T, D]`` the head reads (after the final norm), of the cannjax
    model, with the adapters ``lora`` (scaled by ``lora_scale``) if given; for losses
    that take hidden states and the head (``ops.linear_preference_loss``)."""
    o, (params, lora) = _cannjax_ops(), in_compute_dtype((params, lora), cfg.dtype)
    _check_lora(lora, cfg)
    return _features(o, params, tokens, cfg, lora, lora_scale)


def plain_llama_hidden(
    params: LlamaParams,
    tokens: jax.Array,
    cfg: LlamaConfig,
    *,
    lora: LlamaLoRA | None = None,
    lora_scale: float = 1.0,
) -> jax.Array:
    """The same features in plain JAX (LoRA as flax.nnx's ``LoRALinear`` computes it)."""
    params, lora = in_compute_dtype((params, lora), cfg.dtype)
    _check_lora(lora, cfg)
    return _features(_PLAIN, params, tokens, cfg, lora, lora_scale)


def _check_lora(lora, cfg: LlamaConfig) -> None:
    if lora is None:
        return
    if not isinstance(lora, LlamaLoRA):
        raise TypeError(
            f"cannjax.models: lora must be a LlamaLoRA (cannjax.models.init_llama_lora) or "
            f"None, got {type(lora).__name__}"
        )
    a = lora.w_qkv[0]
    if a.ndim != 3 or a.shape[:2] != (cfg.layers, cfg.width):
        raise ValueError(
            f"cannjax.models: lora.w_qkv's a must have shape [L, D, r] == "
            f"[{cfg.layers}, {cfg.width}, r], got {tuple(a.shape)}; make the adapters with "
            f"init_llama_lora(key, cfg, rank)"
        )


def _loss(o, params, tokens, targets, cfg, weights, lora=None, lora_scale=1.0):
    params, lora = in_compute_dtype((params, lora), cfg.dtype)
    _check_lora(lora, cfg)
    return loss_dtype(_loss_in(o, params, tokens, targets, cfg, weights, lora, lora_scale))


def _loss_in(o, params, tokens, targets, cfg, weights, lora=None, lora_scale=1.0):
    x = _features(o, params, tokens, cfg, lora, lora_scale)
    x, targets = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
    if weights is None:
        return o.mean_cross_entropy(x, _head(params), targets)
    losses = o.cross_entropy(x, _head(params), targets)
    w = weights.reshape(-1).astype(losses.dtype)
    return jnp.sum(losses * w) / jnp.maximum(jnp.sum(w), 1)


def llama_loss(params, tokens, targets, cfg: LlamaConfig, weights=None, *,
               lora: LlamaLoRA | None = None, lora_scale: float = 1.0) -> jax.Array:  # fmt: skip
    """Mean next-token cross-entropy of the cannjax model (optionally weighted per token).

    Without ``weights`` the loss is ``ops.linear_cross_entropy(..., reduction="mean",
    ignore_index=None)`` through the head (every token counts), which never holds the
    ``[B T, V]`` logits. With ``lora`` (:func:`init_llama_lora`) every projection is
    ``ops.lora_linear(x, W, a, b, scale=lora_scale)``: differentiate with respect to the
    adapters, the base weights frozen (LoRA fine-tuning).
    """
    return _loss(_cannjax_ops(), params, tokens, targets, cfg, weights, lora, lora_scale)


def plain_llama_loss(
    params,
    tokens,
    targets,
    cfg: LlamaConfig,
    weights=None,
    *,
    lora: LlamaLoRA | None = None,
    lora_scale: float = 1.0,
) -> jax.Array:
    """The same loss in plain JAX (optax's cross-entropy on the full logits; LoRA as
    flax.nnx's ``LoRALinear`` computes it, ``x @ W + scale * (x @ a @ b)``)."""
    return _loss(_PLAIN, params, tokens, targets, cfg, weights, lora, lora_scale)
