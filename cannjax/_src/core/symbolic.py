"""Size comparisons that stay decidable under symbolic shapes (``jax.export``).

Choices between equal computations (which operand to transpose, whether a fused cluster
keeps its derivative) compare sizes; under ``jax.export.symbolic_shape`` such a
comparison may be undecidable. :func:`less` then returns the caller's default instead of
raising.
"""

from __future__ import annotations

from typing import Any

import jax


def less(a: Any, b: Any, *, undecided: bool) -> bool:
    """``a < b`` for (possibly symbolic) sizes; ``undecided`` where it cannot be decided."""
    try:
        return bool(a < b)
    except jax.errors.InconclusiveDimensionOperation:
        return undecided
