"""Side-by-side timing and memory helpers shared by the benchmark suites.

Timing follows DESIGN.md: one process, candidates interleaved (A B A B ...) after
warm-up, ``jax.block_until_ready``, median of repeated runs, reported as a ratio with
the spread (interquartile range / median).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

RESULTS = Path(__file__).resolve().parent / "results"


def interleaved_times(
    fns: Sequence[Callable[[], Any]], *, repeats: int = 15, warmup: int = 2
) -> list[dict[str, float]]:
    """Times each zero-argument function, interleaved; returns median and spread (s)."""
    for f in fns:
        for _ in range(warmup):
            jax.block_until_ready(f())
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for f, s in zip(fns, samples):
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            s.append(time.perf_counter() - t0)
    out = []
    for s in samples:
        q = statistics.quantiles(s, n=4)
        med = statistics.median(s)
        out.append({"median_s": med, "iqr_rel": (q[2] - q[0]) / med, "n": len(s)})
    return out


def temp_bytes(fn: Callable[..., Any], *args: Any) -> int:
    """Compiled temp memory of ``jax.jit(fn)`` at ``args``."""
    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def machine() -> dict[str, str]:
    """What the figures were measured on."""
    return {
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "cpu_count": str(__import__("os").cpu_count()),
    }


def write_results(name: str, payload: dict[str, Any], table: str) -> None:
    """Writes ``results/<name>.json`` and ``results/<name>.md``."""
    RESULTS.mkdir(exist_ok=True)
    payload = {"machine": machine(), **payload}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    (RESULTS / f"{name}.md").write_text(table.rstrip() + "\n")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
