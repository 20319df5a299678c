"""cannjax.optimize on transformer code from libraries nobody here wrote
(``benchmarks/corpus``: penzai, haliax, transformers' Flax models, flax.nnx, equinox), at
the corpus's small size: the gradients stay the plain step's, and what optimize finds
never falls below what it found when these tests were written, nor claims more than the
architecture holds. ``benchmarks/optimize_corpus.py`` measures the rest (issue 24)."""

import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import corpus  # noqa: E402
import optimize_corpus  # noqa: E402

MODELS = corpus.models()

# Found per kind (attention, norm, dense, activation, loss), as measured when the
# structural RMS-norm finder, flax's onehot loss and attention by meaning were added: the
# floor a change may
# raise and must not lower.
# benchmarks/results/optimize_corpus.md has what the architecture holds beside it.
FLOOR = {
    "penzai-llama": (2, 5, 15, 2, 0),
    "penzai-gemma2": (2, 9, 15, 5, 0),
    "haliax-llama": (2, 5, 7, 2, 0),
    "hf-llama": (2, 5, 15, 2, 1),
    "hf-gemma": (2, 5, 15, 2, 1),
    "hf-gpt2": (2, 5, 9, 2, 1),
    "hf-mistral": (2, 5, 15, 2, 1),
    "nnx-gpt": (2, 5, 13, 2, 1),
    "equinox-llama": (2, 5, 11, 2, 1),
}


def test_the_corpus_has_what_issue_24_asks_for():
    libraries = {m.library for m in MODELS.values()}
    assert len(MODELS) >= 5 and len(libraries) >= 4, (len(MODELS), libraries)
    features = {f for m in MODELS.values() for f in m.features}
    for needed in ("GQA", "RoPE", "soft-cap", "tied embeddings", "named axes"):
        assert needed in features, needed
    assert set(FLOOR) == set(MODELS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_optimize_keeps_the_gradients_and_what_it_found(name):
    # Third-party code broadcasts ranks implicitly (this suite raises on it elsewhere).
    with jax.numpy_rank_promotion("allow"):
        r = optimize_corpus.measure(MODELS[name], corpus.SIZES["small"], timed=False, repeats=0)
    assert r["grad_rel"] <= 1e-5, r["grad_rel"]
    for kind, floor in zip(corpus.KINDS, FLOOR[name]):
        assert floor <= r["found"][kind] <= r["present"][kind], (kind, r["found"], r["present"])
