"""Side-by-side timing and memory helpers shared by the benchmark suites.

Timing follows DESIGN.md: one process, candidates interleaved after warm-up, the order
rotating each round (A B C, B C A, C A B, ...: no candidate always holds the same place),
``jax.block_until_ready``, median of repeated runs, reported as a ratio with the spread
(interquartile range / median).

Where results go: :data:`RESULTS`, the folder named by ``$CANNJAX_BENCH_RESULTS``, else
``build/bench/results/`` of the clone (ignored by git). The committed results in
``benchmarks/results/`` (:data:`COMMITTED`) are written only by ``cannjax bench --write``,
which sets the variable to that folder; a suite run directly never overwrites them.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

# The committed results (benchmarks/README.md is assembled from them).
COMMITTED = Path(__file__).resolve().parent / "results"
# The environment variable naming the folder a suite writes its results to.
RESULTS_ENV = "CANNJAX_BENCH_RESULTS"
# This run's results folder: see the module docstring.
_DEFAULT = Path(__file__).resolve().parents[1] / "build" / "bench" / "results"
RESULTS = Path(os.environ.get(RESULTS_ENV) or _DEFAULT).resolve()


def round_order(n: int, round_: int) -> list[int]:
    """Indices ``0..n-1`` in the order round ``round_`` runs them: rotated by the round.

    Round ``r`` starts at ``r mod n`` (``[1, 2, 0]`` for ``n=3, r=1``), so over ``n``
    rounds each candidate takes each place in the round once: whatever favours the first
    or the last of a round (a pause before it, the machine's load drifting) falls on all
    alike. The amp suite rotates its variants the same way.
    """
    start = round_ % n if n else 0
    return [*range(start, n), *range(start)]


def interleaved_times(
    fns: Sequence[Callable[[], Any]],
    *,
    repeats: int = 15,
    warmup: int = 2,
    samples: bool = False,
    cpu_time: bool = False,
) -> list[dict[str, Any]]:
    """Times each zero-argument function, interleaved; returns median and spread (s).

    Each function runs ``warmup`` times, then the functions run in turn ``repeats``
    times, each round in the order of :func:`round_order` (A B C, B C A, C A B, ...).
    ``samples=True`` adds each function's wall times, one per round (``samples_s``; index
    ``i`` of every function is the same round, for per-pair ratios). ``cpu_time=True``
    also records the process CPU time of each run (``time.process_time()``, all
    threads): ``cpu_samples_s`` and ``cpu_median_s``.
    """
    for f in fns:
        for _ in range(warmup):
            jax.block_until_ready(f())
    walls: list[list[float]] = [[] for _ in fns]
    cpus: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        for i in round_order(len(fns), r):
            f, w, c = fns[i], walls[i], cpus[i]
            c0 = time.process_time() if cpu_time else 0.0
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            w.append(time.perf_counter() - t0)
            if cpu_time:
                c.append(time.process_time() - c0)
    out = []
    for w, c in zip(walls, cpus):
        med = statistics.median(w)
        q = statistics.quantiles(w, n=4) if len(w) > 1 else [w[0]] * 3
        r: dict[str, Any] = {"median_s": med, "iqr_rel": (q[2] - q[0]) / med, "n": len(w)}
        if samples:
            r["samples_s"] = w
        if cpu_time:
            r["cpu_median_s"] = statistics.median(c)
            r["cpu_samples_s"] = c
        out.append(r)
    return out


def paired_ratio(fa: Callable[..., Any], fb: Callable[..., Any], args: Sequence[Any],
                 runs: int) -> dict[str, Any]:  # fmt: skip
    """Median times (ms) of ``fa(*args)`` (ours) and ``fb(*args)`` (plain), run interleaved
    ``runs`` times after one warm-up each; their ratio and the ``[min, max]`` of the
    per-round ratios."""
    a, b = interleaved_times(
        [lambda: fa(*args), lambda: fb(*args)], repeats=runs, warmup=1, samples=True
    )
    ratios = [x / y for x, y in zip(a["samples_s"], b["samples_s"])]
    return {
        "ours_ms": 1e3 * a["median_s"],
        "plain_ms": 1e3 * b["median_s"],
        "ratio": a["median_s"] / b["median_s"],
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "runs": runs,
    }


def temp_bytes(fn: Callable[..., Any], *args: Any) -> int:
    """Compiled temp memory of ``jax.jit(fn)`` at ``args``."""
    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def machine() -> dict[str, str]:
    """What the figures were measured on; ``torch``'s version where the suite imported it."""
    out = {
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "cpu_count": str(os.cpu_count()),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = str(getattr(torch, "__version__", "unknown"))
    return out


def write_results(name: str, payload: dict[str, Any], table: str) -> None:
    """Writes ``<name>.json`` and ``<name>.md`` under :data:`RESULTS`."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), **payload}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    (RESULTS / f"{name}.md").write_text(table.rstrip() + "\n")
    print(f"wrote {RESULTS / name}.json and .md")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
