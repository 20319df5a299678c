"""Hugging Face transformers' Flax causal language models (transformers 4.x; version 5
dropped Flax): Llama, Gemma, GPT-2 and Mistral from their own classes.

The loss is ``examples/flax/language-modeling/run_clm_flax.py``'s: the logits shifted by
one, ``optax.softmax_cross_entropy`` against ``flax.training.common_utils.onehot``.
In mixed precision the models take transformers' own ``dtype=`` (the computation's dtype;
the parameters stay float32), as that script's ``--dtype bfloat16`` passes it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax.training.common_utils import onehot

from . import Model, Size, counts


def _finish(model, size: Size, seed: int):
    key = jax.random.key(seed + 1)
    batch = {"input_ids": jax.random.randint(key, (size.batch, size.seq), 0, size.vocab)}

    def loss(params, batch):
        ids = batch["input_ids"]
        logits = model(ids, params=params, train=False)[0]
        shift_logits, shift_labels = logits[..., :-1, :], ids[..., 1:]
        return optax.softmax_cross_entropy(
            shift_logits, onehot(shift_labels, shift_logits.shape[-1])
        ).mean()

    return model.params, batch, loss


def _common(size: Size) -> dict:
    return dict(
        vocab_size=size.vocab,
        hidden_size=size.width,
        intermediate_size=size.ffn,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=size.seq,
    )


def _make(cls, cfg, size: Size, seed: int, compute):
    model = cls(cfg, input_shape=(size.batch, size.seq), seed=seed, dtype=compute or jnp.float32)
    return _finish(model, size, seed)


def llama(size: Size, seed: int = 0, compute=None):
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    cfg = LlamaConfig(**_common(size), rms_norm_eps=1e-6, tie_word_embeddings=False)
    return _make(FlaxLlamaForCausalLM, cfg, size, seed, compute)


def gemma(size: Size, seed: int = 0, compute=None):
    from transformers import FlaxGemmaForCausalLM, GemmaConfig

    cfg = GemmaConfig(
        **_common(size),
        head_dim=size.head_dim,
        hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
    )
    return _make(FlaxGemmaForCausalLM, cfg, size, seed, compute)


def gpt2(size: Size, seed: int = 0, compute=None):
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    cfg = GPT2Config(
        vocab_size=size.vocab,
        n_positions=size.seq,
        n_embd=size.width,
        n_layer=size.layers,
        n_head=size.heads,
        n_inner=size.ffn,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return _make(FlaxGPT2LMHeadModel, cfg, size, seed, compute)


def mistral(size: Size, seed: int = 0, compute=None):
    from transformers import FlaxMistralForCausalLM, MistralConfig

    cfg = MistralConfig(
        **_common(size), sliding_window=size.window, rms_norm_eps=1e-6, tie_word_embeddings=False
    )
    return _make(FlaxMistralForCausalLM, cfg, size, seed, compute)


HALF_SETTING = "the model's dtype=jnp.bfloat16"

MODELS = (
    Model(
        "hf-llama",
        "transformers",
        ("GQA", "RoPE", "SwiGLU", "RMS norm"),
        llama,
        counts,
        HALF_SETTING,
    ),
    Model(
        "hf-gemma",
        "transformers",
        ("GQA", "RoPE", "GeGLU", "RMS norm (1 + w)", "tied embeddings"),
        gemma,
        counts,
        HALF_SETTING,
    ),
    # GPT-2's attention projects q, k and v with one fused weight (c_attn): 4 per layer.
    Model(
        "hf-gpt2",
        "transformers",
        ("learned positions", "layer norm", "GELU", "fused qkv", "tied embeddings"),
        gpt2,
        lambda size: counts(size, dense_per_layer=4, rope=False),
        HALF_SETTING,
    ),
    Model(
        "hf-mistral",
        "transformers",
        ("GQA", "RoPE", "SwiGLU", "RMS norm", "sliding window"),
        mistral,
        counts,
        HALF_SETTING,
    ),
)
