"""Reading the collectives of a compiled program: how many, and how many bytes per step.

Both read the compiled HLO text (``Compiled.as_text()``): the partitioner's collectives
exist only after compilation.
"""

from __future__ import annotations

import math
import re
from typing import Any

_COLLECTIVES = ("all-reduce", "all-to-all", "all-gather", "reduce-scatter", "collective-permute")
_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(.*?)\s+(" + "|".join(_COLLECTIVES) + r")(-start)?\(([^)]*)\)"
)
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}  # fmt: skip
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%(\S+)\s.*\{\s*$")
_CALLEE = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _text(lowered_or_compiled: Any) -> str:
    obj = lowered_or_compiled
    if hasattr(obj, "compile"):
        obj = obj.compile()
    return obj if isinstance(obj, str) else obj.as_text()


def collective_counts(lowered_or_compiled: Any) -> dict[str, dict[str, int]]:
    """Counts collectives in compiled HLO: instructions and the buffers they move.

    Args:
      lowered_or_compiled: a ``jax.stages.Lowered`` (it is compiled) or ``Compiled``, or
        the compiled HLO text.

    Returns:
      ``{kind: {"ops": instructions, "buffers": operands}}`` for all-reduce, all-to-all,
      all-gather, reduce-scatter and collective-permute (asynchronous ``-start`` forms
      counted once). The runtime issues one collective per buffer. Instructions, not
      executions: one in a loop body counts once (:func:`collective_bytes` counts each
      execution).

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
    counts = {k: {"ops": 0, "buffers": 0} for k in _COLLECTIVES}
    for line in _text(lowered_or_compiled).splitlines():
        m = _OP.search(line)
        if m:
            counts[m.group(2)]["ops"] += 1
            counts[m.group(2)]["buffers"] += len([a for a in m.group(4).split(",") if a.strip()])
    return counts


def _nbytes(shapes: str) -> int:
    return sum(
        _BYTES.get(dtype, 0) * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in _ARRAY.findall(shapes)
    )


def collective_bytes(lowered_or_compiled: Any) -> dict[str, int]:
    """Bytes the collectives of one execution of a compiled program span, per device.

    Each collective counts the larger of its operands and its result: the whole buffer an
    all-reduce reduces, the gathered array of an all-gather, the array a reduce-scatter
    scatters. A collective inside a ``while`` loop counts once per iteration, from the
    trip count XLA proved (``known_trip_count``; loops without one count once), so a
    scan over layers is weighed as it runs.

    Args:
      lowered_or_compiled: a ``jax.stages.Lowered`` (it is compiled) or ``Compiled``, or
        the compiled HLO text.

    Returns:
      ``{kind: bytes}`` for all-reduce, all-to-all, all-gather, reduce-scatter and
      collective-permute, and ``"total"``.

    Example:
      >>> import jax, jax.numpy as jnp, cannjax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = cannjax.parallel.data_mesh()
      >>> def f(x):  # four psums of 8 float32 in a loop
      ...     return jax.lax.fori_loop(0, 4, lambda i, a: jax.lax.psum(a, "data"), x)
      >>> g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P()))
      >>> cannjax.parallel.collective_bytes(g.lower(jnp.ones(8)))["all-reduce"]
      128
    """
    # Computations: their collectives' bytes and the computations they call (with how
    # many times per call: a while body runs trip-count times).
    own: dict[str, dict[str, int]] = {}
    calls: dict[str, list[tuple[str, int]]] = {}
    entry, name = None, None
    for line in _text(lowered_or_compiled).splitlines():
        head = _COMPUTATION.match(line)
        if head:
            name = head.group(2)
            own[name], calls[name] = dict.fromkeys(_COLLECTIVES, 0), []
            entry = name if head.group(1) else entry
            continue
        if name is None:
            continue
        m = _OP.search(line)
        if m:
            own[name][m.group(2)] += max(_nbytes(m.group(1)), _nbytes(m.group(4)))
        trip = _TRIP_COUNT.search(line)
        for role, callee in _CALLEE.findall(line):
            calls[name].append((callee, int(trip.group(1)) if trip and role == "body" else 1))
        for branches in _BRANCHES.findall(line):
            calls[name] += [(b.strip().lstrip("%"), 1) for b in branches.split(",")]

    def total(comp: str, seen: tuple[str, ...] = ()) -> dict[str, int]:
        out = dict(own.get(comp, {}))
        for callee, times in calls.get(comp, []):
            if callee in own and callee not in seen:
                for k, v in total(callee, (*seen, comp)).items():
                    out[k] = out.get(k, 0) + times * v
        return out

    if entry is None:
        raise ValueError("cannjax.parallel.collective_bytes: no ENTRY computation in the HLO")
    result = {k: total(entry).get(k, 0) for k in _COLLECTIVES}
    result["total"] = sum(result.values())
    return result
