"""Keras 3 on the JAX backend: a GPT and a grouped-query decoder from Keras' own layers.

``keras-gpt``: the miniature-GPT example's shape: a token-and-position embedding layer,
``keras.layers.MultiHeadAttention(use_causal_mask=True)`` (its masked ``Softmax``
layer), ``LayerNormalization``, ``Dense(activation="gelu")``. ``keras-gqa``:
``keras.layers.GroupQueryAttention``, ``RMSNormalization``, a SwiGLU MLP of ``Dense``
layers and ``Multiply``. Both are functional ``keras.Model``s trained the way Keras'
"custom training loop in JAX" guide writes it: ``model.stateless_call`` on the
trainable variables' values, the loss ``keras.losses.SparseCategoricalCrossentropy(
from_logits=True)``. Neither family has rotary embeddings.

In mixed precision the models are built under Keras' ``mixed_bfloat16`` dtype policy
(``keras.config.set_dtype_policy``: float32 variables, bfloat16 computation), their logits
returned in float32 by a float32 ``Activation("linear")`` as Keras' mixed-precision guide
ends a model.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402

from . import Model, Size, counts, tokens  # noqa: E402


class TokenAndPosition(keras.layers.Layer):
    def __init__(self, size: Size, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(size.vocab, size.width)
        self.positions = keras.layers.Embedding(size.seq, size.width)

    def call(self, x):
        positions = keras.ops.arange(keras.ops.shape(x)[-1])
        return self.tokens(x) + self.positions(positions)


def _gpt_model(size: Size):
    tokens = keras.Input((size.seq,), dtype="int32")
    x = TokenAndPosition(size)(tokens)
    for _ in range(size.layers):
        h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
        h = keras.layers.MultiHeadAttention(size.heads, size.head_dim)(h, h, use_causal_mask=True)
        x = x + h
        h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
        h = keras.layers.Dense(size.ffn, activation="gelu")(h)
        x = x + keras.layers.Dense(size.width)(h)
    x = keras.layers.LayerNormalization(epsilon=1e-5)(x)
    return keras.Model(tokens, keras.layers.Dense(size.vocab)(x))


def _gqa_model(size: Size):
    tokens = keras.Input((size.seq,), dtype="int32")
    x = keras.layers.Embedding(size.vocab, size.width)(tokens)
    for _ in range(size.layers):
        h = keras.layers.RMSNormalization(epsilon=1e-6)(x)
        attn = keras.layers.GroupQueryAttention(
            size.head_dim, size.heads, size.kv_heads, use_bias=False
        )
        x = x + attn(h, h, use_causal_mask=True)
        h = keras.layers.RMSNormalization(epsilon=1e-6)(x)
        gate = keras.layers.Dense(size.ffn, activation="silu", use_bias=False)(h)
        up = keras.layers.Dense(size.ffn, use_bias=False)(h)
        h = keras.layers.Multiply()([gate, up])
        x = x + keras.layers.Dense(size.width, use_bias=False)(h)
    x = keras.layers.RMSNormalization(epsilon=1e-6)(x)
    return keras.Model(tokens, keras.layers.Dense(size.vocab, use_bias=False)(x))


def _built(make, size: Size, compute):
    """``make(size)``, under the ``mixed_<compute>`` dtype policy when ``compute`` is set,
    its logits then returned in float32."""
    if compute is None:
        return make(size)
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy(f"mixed_{keras.backend.standardize_dtype(compute)}")
    try:
        half = make(size)
    finally:
        keras.config.set_dtype_policy(before)
    logits = keras.layers.Activation("linear", dtype="float32")(half.outputs[0])
    return keras.Model(half.inputs, logits)


def _trained(make):
    def build(size: Size, seed: int = 0, compute=None):
        keras.utils.set_random_seed(seed)
        model = _built(make, size, compute)
        batch = tokens(size, seed)
        params = [v.value for v in model.trainable_variables]
        fixed = [v.value for v in model.non_trainable_variables]
        cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def loss(params, batch):
            logits, _ = model.stateless_call(params, fixed, batch["tokens"][:, :-1])
            return cross_entropy(batch["tokens"][:, 1:], logits)

        return params, batch, loss

    return build


HALF_SETTING = 'the "mixed_bfloat16" dtype policy, float32 logits'

MODELS = (
    Model(
        "keras-gpt",
        "keras",
        ("keras.layers.MultiHeadAttention", "layer norm", "GELU (erf)"),
        _trained(_gpt_model),
        lambda size: counts(size, dense_per_layer=6, rope=False),
        HALF_SETTING,
    ),
    Model(
        "keras-gqa",
        "keras",
        ("keras.layers.GroupQueryAttention", "RMS norm", "SwiGLU"),
        _trained(_gqa_model),
        lambda size: counts(size, dense_per_layer=7, rope=False),
        HALF_SETTING,
    ),
)
