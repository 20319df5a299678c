"""Loop carries inside ``jax.shard_map``: typed to vary as the values that flow into them.

Under ``shard_map`` (``check_vma=True``, its default) every value carries the set of
mesh axes it varies over, and ``lax.scan`` requires a carry to keep its type. A carry
started from ``jnp.zeros`` is invariant, but the operators' loop bodies add varying inputs
into it (a local batch, a local block of keys), so it must start varying over the same
axes: :func:`varying_like` casts it there (``lax.pcast(..., to="varying")``, no data
movement). Outside ``shard_map`` it returns its argument.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes ``x`` varies over (empty outside ``shard_map``)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax >= 0.9: the manual-axis type
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))


def varying_like(tree: Any, *refs: Any, axes: tuple[str, ...] = ()) -> Any:
    """``tree`` with each array cast to vary over every axis some leaf of ``refs`` does,
    and over ``axes`` (the axis of a ``ppermute`` in the loop, whose result varies)."""
    axes = frozenset(axes).union(*(varying_axes(r) for r in jax.tree.leaves(refs)))
    if not axes:
        return tree

    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)
