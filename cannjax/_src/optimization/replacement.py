"""What a finder returns: the idiom it found, as the cannjax operator that computes it.

A leaf module (no import from the finders or the planner), so every finder imports it
at the top and the planner (:mod:`rewrite`) reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class Replacement:
    """One idiom replaced by a cannjax operator.

    Attributes:
      kind: ``"attention"``, ``"norm"``, ``"gated"``, ``"lora"``, ``"rope"``, ``"dense"``,
        ``"activation"``, ``"softmax"`` or ``"loss"``.
      op: the cannjax operator (``"layer_norm"``).
      source: the code the idiom was found as (``"flax.nnx"``, ``"jax.nn.gelu"``).
      inputs: the user atoms the operator reads (None for an absent scale or bias).
      covered: indices of the equations it replaces.
      out: the user var it computes.
      call: computes ``out`` from the values of ``inputs``.
      line: the user source line of its last equation.
    """

    kind: str
    op: str
    source: str
    inputs: tuple
    covered: frozenset
    out: Any
    call: Callable[..., Any]
    line: str = "?"
    recomputed: bool = False  # recomputed in its readers' backward (recompute_producers)
