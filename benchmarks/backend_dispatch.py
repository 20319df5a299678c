"""Cost of the Ascend kernel table on a CPU: tracing/lowering time, run time, memory.

A: the Ascend entries installed (gelu, silu, sigmoid, tanh, exp, relu, softplus have
platform alternatives, dropped when lowering for cpu). B: entries removed.
Interleaved A B A B after warm-up; median of N runs; ratios A/B with spread.

Run: PYTHONPATH=. python benchmarks/backend_dispatch.py [--quick]. Writes
backend_dispatch.json and .md to the results folder (build/bench/results/, or
benchmarks/results/ under cannjax bench --write: see benchmarks/_harness.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
from _harness import RESULTS

import cannjax
from cannjax.backend import ascend

OPS = ("gelu", "silu", "sigmoid", "tanh", "exp", "relu", "softplus")


def step(x):
    def loss(x):
        y = x
        for name in OPS:
            y = getattr(cannjax.ops, name)(y if name != "exp" else -jnp.abs(y))
        return (y * y).sum()

    return jax.value_and_grad(loss)(x)


def lower_time(x):
    f = jax.jit(lambda x: step(x))  # a fresh function: no trace cache
    t0 = time.perf_counter()
    f.lower(x)
    return time.perf_counter() - t0


def compiled(x):
    return jax.jit(lambda x: step(x)).lower(x).compile()


def run_time(c, x, reps):
    jax.block_until_ready(c(x))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = c(x)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def with_table(on, fn, *a):
    if on:
        ascend.install()
    else:
        ascend.uninstall()
    try:
        return fn(*a)
    finally:
        ascend.install()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    n = 10 if args.quick else 20
    x = jax.random.normal(jax.random.key(0), (256, 1024), jnp.float32)
    ca, cb = with_table(True, compiled, x), with_table(False, compiled, x)
    for _ in range(2):  # warm-up
        with_table(True, lower_time, x), with_table(False, lower_time, x)
    lt = {"A": [], "B": []}
    rt = {"A": [], "B": []}
    for _ in range(n):
        lt["A"].append(with_table(True, lower_time, x))
        lt["B"].append(with_table(False, lower_time, x))
        rt["A"].append(run_time(ca, x, 5))
        rt["B"].append(run_time(cb, x, 5))

    def summary(d):
        ratios = [a / b for a, b in zip(d["A"], d["B"])]
        return {
            "median_A_ms": 1e3 * statistics.median(d["A"]),
            "median_B_ms": 1e3 * statistics.median(d["B"]),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }

    ma, mb = ca.memory_analysis(), cb.memory_analysis()
    result = {
        "command": "PYTHONPATH=. python benchmarks/backend_dispatch.py" + (" --quick" * args.quick),
        "runs": n,
        "shape": list(x.shape),
        "trace_and_lower": summary(lt),
        "run": summary(rt),
        "temp_bytes_A": ma.temp_size_in_bytes,
        "temp_bytes_B": mb.temp_size_in_bytes,
        "conditional_in_compiled_A": "conditional" in ca.as_text(),
    }
    out = RESULTS  # build/bench/results unless cannjax bench --write (_harness.py)
    out.mkdir(parents=True, exist_ok=True)
    (out / "backend_dispatch.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [
        "| measure | A: Ascend table (ms) | B: no table (ms) | A/B median [min, max] |",
        "|---|---|---|---|",
    ]
    for name in ("trace_and_lower", "run"):
        s = result[name]
        rows.append(
            f"| {name} | {s['median_A_ms']:.2f} | {s['median_B_ms']:.2f} | "
            f"{s['ratio_median']:.2f} [{s['ratio_min']:.2f}, {s['ratio_max']:.2f}] |"
        )
    rows.append(f"| compiled temp bytes | {ma.temp_size_in_bytes} | {mb.temp_size_in_bytes} | |")
    md = "\n".join(
        [
            "# backend_dispatch: cost of the Ascend kernel table on CPU",
            "",
            f"`{result['command']}`; value_and_grad of a 7-op chain on f32{list(x.shape)}, "
            f"{n} interleaved runs. Shared 2-core machine: times are noisy.",
            "",
            *rows,
            "",
        ]
    )
    (out / "backend_dispatch.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
