"""Held-out models for ``optimize_corpus.py --set heldout``: libraries and families that
``benchmarks/corpus`` does not hold and that no finder was written against.

dm-haiku, Keras 3 on the JAX backend and flax.linen's own layers (the corpus has flax.nnx,
equinox, penzai, haliax and transformers' Flax models), each as a GPT built from the
library's attention, norm and dense classes, and as a Llama-style decoder (RMS norm,
rotary embeddings, grouped-query heads, a SwiGLU MLP) written the way that library's users
write one. The same :class:`corpus.Model` interface and :func:`corpus.counts`; the
figures of the first measurement are kept in the results beside the later ones, so that
what was found before any finder saw these models stays on record.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from corpus import KINDS, SIZES, Model, Size, counts  # noqa: E402, F401


def tokens(size: Size, seed: int) -> dict:
    """A batch of ``size.batch`` random token rows of ``size.seq + 1`` (inputs and
    next-token labels), as every held-out model's loss takes it."""
    import jax  # noqa: PLC0415 -- the package imports no library until a model is built

    key = jax.random.key(seed + 1)
    return {"tokens": jax.random.randint(key, (size.batch, size.seq + 1), 0, size.vocab)}


def models() -> dict[str, Model]:
    """Every held-out model, by name (imports the libraries)."""
    from . import haiku_models, keras_models, linen_models

    out = {}
    for mod in (haiku_models, keras_models, linen_models):
        out.update({m.name: m for m in mod.MODELS})
    return out
