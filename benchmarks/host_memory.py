"""The GPT step with glibc keeping freed memory (``cannjax.backend.keep_freed_memory``).

Run: ``PYTHONPATH=. python benchmarks/host_memory.py [--quick | --smoke]``

The allocator is a setting of the whole process, so the two candidates cannot share one
process. Each round runs one child process per candidate and precision, the candidates'
order rotating from round to round (``_harness.round_order``); a child builds the step of
``benchmarks/gpt.py`` (the cannjax GPT, Adam, float32 or bfloat16 compute with float32
master weights), runs it ``--warmup`` times (the heap settles over the first steps), then
times ``--steps`` steps. Reported per precision: the median over rounds of each
candidate's median step time, the median of the per-round ratios, and per step the minor
page faults and the system time (``getrusage``), which do not depend on the load. Each
child also measures the machine's f32 and bf16 matmul ceilings (``gpt.matmul_ceilings``),
quoted beside the throughputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt  # noqa: E402
import jax  # noqa: E402
from _harness import markdown_table, round_order, write_results  # noqa: E402

import cannjax  # noqa: E402

CANDIDATES = ("default allocator", "keep_freed_memory()")
PRECISIONS = ("float32", "bfloat16")


def child(candidate: str, precision: str, warmup: int, steps: int, smoke: bool) -> dict:
    """One candidate's step in this process: times, faults and system time per step."""
    # Nothing above has started JAX's backend, so the allocator can still be set.
    applied = cannjax.backend.keep_freed_memory() if candidate == CANDIDATES[1] else False
    m = gpt.model("gpt", smoke)
    cfg = dataclasses.replace(m.cfg, dtype=None if precision == "float32" else precision)
    cfg, params, tokens, targets, opt, state = gpt.setup(m.batch, cfg, m.init)
    step = gpt.step_fn(m.loss, cfg, opt)
    temp = step.lower(params, state, tokens, targets).compile().memory_analysis()
    run = gpt.training_loop(step, params, state, tokens, targets)
    for _ in range(warmup):
        jax.block_until_ready(run())
    times = []
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - t0)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    ceilings = gpt.matmul_ceilings(256, 2) if smoke else gpt.matmul_ceilings(repeats=3)
    return {
        "applied": applied,
        "median_s": statistics.median(times),
        "faults_per_step": (r1.ru_minflt - r0.ru_minflt) / steps,
        "sys_s_per_step": (r1.ru_stime - r0.ru_stime) / steps,
        "temp_bytes": int(temp.temp_size_in_bytes),
        "gflop_per_step": m.flops(cfg, m.batch) / 1e9,
        "ceilings": ceilings,
    }


def spawn(candidate: str, precision: str, a: argparse.Namespace) -> dict:
    args = [sys.executable, __file__, "--child", candidate, precision]
    args += ["--warmup", str(a.warmup), "--steps", str(a.steps)] + ["--smoke"] * a.smoke
    out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="2 rounds")
    size.add_argument("--smoke", action="store_true", help="a tiny model, 1 round")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 4)")
    p.add_argument("--warmup", type=int, default=None, help="steps before timing (20)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per child (10)")
    p.add_argument("--child", nargs=2, metavar=("CANDIDATE", "PRECISION"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.rounds = a.rounds or (1 if a.smoke else 2 if a.quick else 4)
    a.warmup = a.warmup or (2 if a.smoke else 20)
    a.steps = a.steps or (2 if a.smoke else 10)
    if a.child:
        print(json.dumps(child(*a.child, a.warmup, a.steps, a.smoke)))
        return
    runs = {(c, p): [] for p in PRECISIONS for c in CANDIDATES}
    for r in range(a.rounds):
        for precision in PRECISIONS:
            for i in round_order(len(CANDIDATES), r):
                res = spawn(CANDIDATES[i], precision, a)
                runs[CANDIDATES[i], precision].append(res)
                print(f"round {r}: {precision}, {CANDIDATES[i]}: {1e3 * res['median_s']:.0f} ms")
    rows, summary = [], {}
    for precision in PRECISIONS:
        base, kept = (runs[c, precision] for c in CANDIDATES)
        ratios = [b["median_s"] / k["median_s"] for b, k in zip(base, kept)]
        for c in CANDIDATES:
            rs = runs[c, precision]
            t = statistics.median(x["median_s"] for x in rs)
            ceiling = statistics.median(x["ceilings"][precision] for x in rs)
            rate = rs[0]["gflop_per_step"] / t
            summary[f"{precision}, {c}"] = {
                "median_s": t,
                "faults_per_step": statistics.median(x["faults_per_step"] for x in rs),
                "sys_s_per_step": statistics.median(x["sys_s_per_step"] for x in rs),
                "temp_bytes": rs[0]["temp_bytes"],
                "applied": all(x["applied"] for x in rs),
                "ceiling_gflops": ceiling,
            }
            s = summary[f"{precision}, {c}"]
            rows.append(
                [
                    precision,
                    c,
                    f"{1e3 * t:.0f}",
                    f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]"
                    if c == CANDIDATES[1]
                    else "1.00",
                    f"{s['faults_per_step']:.0f}",
                    f"{1e3 * s['sys_s_per_step']:.0f}",
                    f"{s['temp_bytes'] / 2**20:.0f}",
                    f"{rate:.0f} of {ceiling:.0f}",
                ]
            )
    md = markdown_table(
        [
            "precision",
            "allocator",
            "step ms",
            "speed-up [min, max over rounds]",
            "page faults / step",
            "system ms / step",
            "temp MiB",
            "GFLOP/s of the precision's matmul ceiling",
        ],
        rows,
    )
    md += (
        f"\n\nThe GPT step of `benchmarks/gpt.py` (cannjax model, Adam), {a.rounds} rounds of "
        "one child process per candidate and precision, candidates' order rotating; each "
        f"child warms up {a.warmup} steps and times {a.steps}. Speed-up: default step time / "
        "kept step time, per round. Ceilings: 2048^3 matmul, f32 and bf16 x bf16 -> f32, "
        "measured in each child."
    )
    if a.smoke:
        md += " Smoke run (--smoke): a tiny model; the figures mean nothing."
    cmd = "benchmarks/host_memory.py" + (" --smoke" if a.smoke else " --quick" if a.quick else "")
    write_results(
        "host_memory",
        {"command": cmd, "rounds": a.rounds, "smoke": a.smoke, "results": summary},
        md,
    )
    print(md)


if __name__ == "__main__":
    main()
