"""penzai (named axes): its Llama-like transformer builder, as a Llama and as a Gemma 2.

The loss is written as penzai's users write it: the model's named ``vocabulary`` axis
goes through ``nmap(jax.nn.log_softmax)`` and is indexed by the targets.
"""

from __future__ import annotations

import jax
from penzai import pz
from penzai.models.transformer.variants import llamalike_common as llc

from . import Model, Size, counts


def _config(size: Size, **kw) -> llc.LlamalikeTransformerConfig:
    return llc.LlamalikeTransformerConfig(
        num_kv_heads=size.kv_heads,
        query_head_multiplier=size.heads // size.kv_heads,
        embedding_dim=size.width,
        projection_dim=size.head_dim,
        mlp_hidden_dim=size.ffn,
        num_decoder_blocks=size.layers,
        vocab_size=size.vocab,
        **kw,
    )


def _finish(cfg, size: Size, seed: int):
    model = llc.build_llamalike_transformer(cfg, init_base_rng=jax.random.key(seed))
    unbound, params = pz.unbind_params(model, freeze=True)
    key = jax.random.key(seed + 1)
    batch = {"tokens": jax.random.randint(key, (size.batch, size.seq + 1), 0, size.vocab)}

    def loss(params, batch):
        m = pz.bind_variables(unbound, params)
        tokens = pz.nx.wrap(batch["tokens"]).tag("batch", "seq")
        logits = m(tokens[{"seq": pz.slice[:-1]}])
        log_probs = pz.nx.nmap(jax.nn.log_softmax)(logits.untag("vocabulary")).tag("vocabulary")
        picked = log_probs[{"vocabulary": tokens[{"seq": pz.slice[1:]}]}]
        return -picked.untag("batch", "seq").unwrap().mean()

    return params, batch, loss


def llama(size: Size, seed: int = 0):
    cfg = _config(size, mlp_variant="swiglu", tie_embedder_and_logits=False, rms_norm_eps=1e-6)
    return _finish(cfg, size, seed)


def gemma2(size: Size, seed: int = 0):
    cfg = _config(
        size,
        mlp_variant="geglu_approx",
        tie_embedder_and_logits=True,
        attention_type=(
            llc.AttentionTypeSlidingWindowCausal(size.window),
            llc.AttentionTypeGlobalCausal(),
        ),
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        final_logit_softcap=30.0,
        attn_logits_soft_cap=50.0,
    )
    return _finish(cfg, size, seed)


MODELS = (
    Model(
        "penzai-llama",
        "penzai",
        ("GQA", "RoPE", "SwiGLU", "RMS norm", "named axes"),
        llama,
        counts,
    ),
    Model(
        "penzai-gemma2",
        "penzai",
        (
            "GQA",
            "RoPE",
            "GeGLU",
            "RMS norm",
            "pre+post norms",
            "soft-cap",
            "sliding window",
            "tied embeddings",
            "named axes",
        ),  # fmt: skip
        gemma2,
        lambda size: counts(size, norms_per_layer=4, soft_caps=True),
    ),
)
