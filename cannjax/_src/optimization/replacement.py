"""What a finder returns: the idiom it found, as the cannjax operator that computes it
(:class:`Replacement`), or why a region that looks like one is not (:class:`Miss`).

Every finder is ``find(graph, eqn index) -> Replacement | Miss | None``: None when nothing
there looks like its idiom. A leaf module (no import from the finders or the planner), so
every finder imports it at the top and the planner (:mod:`rewrite`) reads it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any


class Kind(enum.StrEnum):
    """What a replacement computes (the report's "kind" column)."""

    ATTENTION = "attention"
    NORM = "norm"
    GATED = "gated"
    LORA = "lora"
    ROPE = "rope"
    DENSE = "dense"
    ACTIVATION = "activation"
    SOFTMAX = "softmax"
    LOSS = "loss"


@dataclasses.dataclass
class Replacement:
    """One idiom replaced by a cannjax operator.

    Attributes:
      kind: what it computes.
      op: the cannjax operator (``"layer_norm"``).
      source: the code the idiom was found as (``"flax.nnx"``, ``"jax.nn.gelu"``).
      inputs: the user atoms the operator reads (None for an absent scale or bias).
      covered: indices of the equations it replaces.
      out: the user var it computes.
      call: computes ``out`` from the values of ``inputs``.
      line: the user source line of its last equation.
    """

    kind: Kind
    op: str
    source: str
    inputs: tuple
    covered: frozenset
    out: Any
    call: Callable[..., Any]
    line: str = "?"
    recomputed: bool = False  # recomputed in its readers' backward (recompute_producers)


@dataclasses.dataclass(frozen=True)
class Miss:
    """A region that looks like an idiom but does not compute it (or cannot be replaced),
    and why: shown as a left-alone row by ``cannjax.inspect.optimize``."""

    reason: str

    def __str__(self) -> str:
        return self.reason
