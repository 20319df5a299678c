"""Counting the collectives of a compiled program (how bucketing is verified)."""

from __future__ import annotations

import re
from typing import Any

_COLLECTIVES = ("all-reduce", "all-to-all", "all-gather", "reduce-scatter", "collective-permute")


def collective_counts(lowered_or_compiled: Any) -> dict[str, dict[str, int]]:
    """Counts collectives in compiled HLO: instructions and the buffers they move.

    Args:
      lowered_or_compiled: a ``jax.stages.Lowered`` (it is compiled) or ``Compiled``, or
        the compiled HLO text.

    Returns:
      ``{kind: {"ops": instructions, "buffers": operands}}`` for all-reduce, all-to-all,
      all-gather, reduce-scatter and collective-permute (asynchronous ``-start`` forms
      counted once). The runtime issues one collective per buffer.

    Example:
      >>> import jax, jax.numpy as jnp, cannjax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = cannjax.parallel.data_mesh()
      >>> f = jax.jit(jax.shard_map(lambda a, b: (jax.lax.psum(a, "data"),
      ...     jax.lax.psum(b, "data")), mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> n = len(jax.devices())
      >>> c = cannjax.parallel.collective_counts(f.lower(jnp.ones(n), jnp.ones(n)))
      >>> c["all-reduce"]["buffers"]
      2
    """
    obj = lowered_or_compiled
    if hasattr(obj, "compile"):
        obj = obj.compile()
    text = obj if isinstance(obj, str) else obj.as_text()
    counts = {k: {"ops": 0, "buffers": 0} for k in _COLLECTIVES}
    for line in text.splitlines():
        m = re.search(r"=\s*(.*?)\s+(" + "|".join(_COLLECTIVES) + r")(-start)?\(([^)]*)\)", line)
        if not m:
            continue
        kind = m.group(2)
        counts[kind]["ops"] += 1
        counts[kind]["buffers"] += len([a for a in m.group(4).split(",") if a.strip()])
    return counts
