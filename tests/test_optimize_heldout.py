"""cannjax.optimize on the held-out models (``benchmarks/heldout``: dm-haiku, Keras 3,
flax.linen's own layers; libraries no finder was written against), at the small size:
the gradients stay the plain step's, every finder runs without error (the suite's strict
mode raises on one that fails), and what the architecture holds is found."""

import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import heldout  # noqa: E402
import optimize_corpus  # noqa: E402

from tests._corpus_checks import assert_found_and_as_accurate_in_bfloat16  # noqa: E402
from tests._tiers import sample  # noqa: E402

MODELS = heldout.models()


def test_the_held_out_set_is_outside_the_corpus():
    import corpus  # noqa: PLC0415

    assert {m.library for m in MODELS.values()} == {"dm-haiku", "keras", "flax"}
    assert not set(MODELS) & set(corpus.models())
    # flax's corpus model is flax.nnx; the held-out ones use flax.linen's own layers.
    assert all("nnx" not in n for n in MODELS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_optimize_keeps_the_gradients_and_finds_everything(name):
    with jax.numpy_rank_promotion("allow"):  # the libraries broadcast implicitly
        r = optimize_corpus.measure(MODELS[name], heldout.SIZES["small"], timed=False, repeats=0)
    assert r["grad_rel"] <= 1e-5, r["grad_rel"]
    assert r["found"] == r["present"], (r["found"], r["present"], r["left"])
    assert not any("cannjax bug" in why for why in r["left"]), r["left"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_optimize_finds_everything_in_bfloat16_and_is_as_accurate(name):
    # Mixed precision as tests/test_optimize_corpus.py runs it.
    assert_found_and_as_accurate_in_bfloat16(MODELS[name], heldout.SIZES["small"])


# Each library's own mixed-precision setting: haiku's policies, Keras' mixed_bfloat16,
# linen's dtype= (bfloat16 products, bfloat16 logits or masks where the library keeps them).
@pytest.mark.parametrize("name", sample(sorted(n for n, m in MODELS.items() if m.half_setting)))
def test_optimize_finds_everything_under_the_librarys_own_bfloat16_setting(name):
    assert_found_and_as_accurate_in_bfloat16(MODELS[name], heldout.SIZES["small"], native=True)


def test_every_held_out_library_has_its_own_bfloat16_setting():
    assert all(m.half_setting for m in MODELS.values())


def test_a_zero_gradient_is_measured_against_the_largest():
    # The key bias's gradient is zero in exact arithmetic: its rounding is no error.
    a = {"w": jax.numpy.ones(3), "key_bias": jax.numpy.full(3, 3e-9)}
    b = {"w": jax.numpy.ones(3), "key_bias": jax.numpy.full(3, 1e-9)}
    assert optimize_corpus.grad_rel(a, b) < 1e-5
    # An error in a small but real gradient still counts.
    b_small = {"w": jax.numpy.ones(3), "key_bias": jax.numpy.full(3, 1e-2)}
    a_small = {"w": jax.numpy.ones(3), "key_bias": jax.numpy.full(3, 1.1e-2)}
    assert optimize_corpus.grad_rel(a_small, b_small) > 0.05
