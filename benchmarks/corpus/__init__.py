"""Transformer models from libraries nobody here wrote: the corpus of ``optimize_corpus.py``.

Each model is built from its library's own classes, at a size from :data:`SIZES`, with
random weights, in float32, and with the loss written as that library's users write it
(never with cannjax). The libraries are the ``models`` extra of ``pyproject.toml``;
flax and equinox are dev dependencies already.

``present`` counts what a model holds, from its architecture (not from any matcher):

- ``attention``: attention blocks, one per layer;
- ``norm``: normalization layers (pre-attention and pre-MLP norms per layer, post norms
  where the architecture has them, the final norm);
- ``dense``: weight projections applied by a matrix product (a fused q/k/v or
  gate/up weight counts once, as it is one product; the output head counts once, tied to
  the embedding or not);
- ``activation``: the MLP's activation, one per layer, and each ``tanh`` soft-cap (of
  the attention logits per layer, of the final logits);
- ``loss``: the cross-entropy, one;
- ``rope``: rotary embeddings applied, two per layer (queries and keys) in the families
  with RoPE.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

KINDS = ("attention", "norm", "dense", "activation", "loss", "rope")


@dataclasses.dataclass(frozen=True)
class Size:
    """A model size, shared by every family (heads and widths as the family allows)."""

    layers: int
    width: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    batch: int

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def window(self) -> int:
        """The sliding-window length of the families that have one."""
        return self.seq // 2


SIZES = {
    # Tests (make test) and quick runs.
    "small": Size(layers=2, width=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=32, batch=2),
    # Issue 24's realistic size.
    "realistic": Size(
        layers=4, width=512, heads=8, kv_heads=2, ffn=2048, vocab=8192, seq=1024, batch=4
    ),
}


@dataclasses.dataclass(frozen=True)
class Model:
    """One corpus model.

    Attributes:
      name: ``library-family``.
      library: the PyPI distribution it comes from.
      features: what it exercises (``"GQA"``, ``"RoPE"``, ``"soft-cap"``...).
      build: ``build(size, seed) -> (params, batch, loss)``; ``loss(params, batch)`` is a
        scalar, ``params`` a pytree of float arrays.
      present: ``present(size) -> {kind: count}`` over :data:`KINDS`.
      half_setting: the library's own mixed-precision setting, where it has one (how its
        users ask for half-precision compute over float32 parameters); ``build(size,
        seed, compute=dtype)`` then builds the model with it, the same float32
        parameters as ``build(size, seed)``. Empty where the library has none (its users
        cast the parameters: :func:`in_half_precision`).
    """

    name: str
    library: str
    features: tuple[str, ...]
    build: Callable[[Size, int], tuple[Any, Any, Callable]]
    present: Callable[[Size], dict[str, int]]
    half_setting: str = ""


def counts(
    size: Size,
    *,
    norms_per_layer: int = 2,
    dense_per_layer: int = 7,
    soft_caps: bool = False,
    rope: bool = True,
) -> dict[str, int]:
    """``present`` of a decoder of ``size.layers`` layers with a final norm and a head
    (``soft_caps``: attention logits capped in every layer and the final logits too;
    ``rope``: rotary embeddings on queries and keys)."""
    n = size.layers
    return {
        "attention": n,
        "norm": norms_per_layer * n + 1,
        "dense": dense_per_layer * n + 1,
        "activation": n + (n + 1 if soft_caps else 0),
        "loss": 1,
        "rope": 2 * n if rope else 0,
    }


# The models whose library cannot run them with half-precision parameters (so
# ``in_half_precision`` skips them), and why. tests/test_optimize_corpus.py checks that
# each still fails, so an entry that starts to work is noticed.
HALF_UNSUPPORTED = {
    "haliax-llama": (
        "haliax's layer scan keeps its carry's dtype: the bfloat16 embedding starts a "
        "residual stream its float32 norms turn to float32, and lax.scan refuses the "
        "changed carry (the plain model fails to trace, before optimize)"
    ),
}


def in_half_precision(loss: Callable, dtype: Any) -> Callable:
    """``loss`` computed in ``dtype`` with float32 parameters, as any of these libraries'
    users can train in mixed precision: every floating parameter cast to ``dtype`` at the
    top of the loss, the loss returned in float32 (jmp's policy
    ``params=float32,compute=bfloat16,output=float32``, as dm-haiku's examples apply it;
    ``cast_to_compute`` casts only floating arrays)."""

    def half_loss(params, batch):
        def cast(a):
            return a.astype(dtype) if jnp.issubdtype(jnp.result_type(a), jnp.floating) else a

        return loss(jax.tree.map(cast, params), batch).astype(jnp.float32)

    return half_loss


def models() -> dict[str, Model]:
    """Every corpus model, by name (imports the libraries)."""
    from . import equinox_models, haliax_models, hf_flax_models, nnx_models, penzai_models

    out = {}
    for mod in (penzai_models, haliax_models, hf_flax_models, nnx_models, equinox_models):
        out.update({m.name: m for m in mod.MODELS})
    return out
