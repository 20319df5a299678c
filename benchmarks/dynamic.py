"""Variable-length training with gears: compiles, padding and wall time on a stream of lengths.

Run: ``PYTHONPATH=. python benchmarks/dynamic.py [--quick] [--batches N]``

The targets of issue 18, on a stream of 1,000 batches whose sequence lengths are drawn
from a log-normal (median 64, sigma 0.8), rounded and clipped to [16, 512]
(``cannjax._src.demo.lognormal_lengths`` with ``numpy.random.default_rng(0)``):

* planning (no model run): for k = 4 and 8 and three cost models (linear, quadratic, and
  the GPT step's matmul FLOPs at each length), the programs the planned gears compile
  over the whole stream (target: <= k) against one per distinct length without
  bucketing, and the padded-cost overhead of the planned gears against powers of two
  with the same k (target: ratio <= 0.5). Gears are planned on the stream itself; the
  overhead of gears planned on an independent draw (seed 1) is shown beside;
* gradients: the GPT loss's gradient on batches of the stream padded to their gear with
  ``cannjax.dynamic.pad_to_gear`` (weights passed to ``gpt_loss``) against the unpadded
  batch's (target: relative L2 error <= 1e-5);
* wall time of Adam training steps over the stream, compiles included, for planned gears
  (k = 4 and 8, GPT-FLOP cost), padding everything to 512 and no bucketing (one
  program per distinct length), each a ``cannjax.dynamic.geared`` step with its own
  fresh jitted function and state. The strategies run interleaved batch by batch in one
  process (the order rotated every batch), each step timed to ``block_until_ready``.
  All four run the first N batches (N = 100; ``--quick`` 15); in the full run the three
  padded strategies go on to the end of the stream. One round: a compile happens once,
  so there is no warm-up to discard and no median over repeats; the machine is shared.

The model is small so that the whole run takes minutes on 2 cores:
``GPTConfig(vocab=256, width=64, heads=2, layers=2, seq_len=512)``, batch 4.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import markdown_table, write_results  # noqa: E402
from gpt import matmul_ceiling, model_flops  # noqa: E402

from cannjax import models  # noqa: E402
from cannjax._src.demo import lognormal_lengths  # noqa: E402
from cannjax.dynamic import (  # noqa: E402
    fixed_gears,
    geared,
    pad_to_gear,
    plan_gears,
    power_of_two_gears,
)

STREAM, LOW, HIGH, MEDIAN, SIGMA = 1000, 16, 512, 64, 0.8
KS = (4, 8)
BATCH = 4
CFG = models.GPTConfig(vocab=256, width=64, heads=2, layers=2, seq_len=HIGH)
TARGETS = {"ratio": 0.5, "grad_rel": 1e-5}


def draw(seed: int) -> np.ndarray:
    """The stream's lengths (seed 0), or an independent draw to plan on (seed 1)."""
    rng = np.random.default_rng(seed)
    return lognormal_lengths(rng, STREAM, low=LOW, high=HIGH, median=MEDIAN, sigma=SIGMA)


def gpt_flops(length: int) -> float:
    """Matmul FLOPs of one training step of the benchmark's GPT at ``length``."""
    return model_flops(dataclasses.replace(CFG, seq_len=int(length)), BATCH)


COSTS = {"linear": "linear", "quadratic": "quadratic", "GPT FLOPs": gpt_flops}


def mark(ok: bool) -> str:
    return "pass" if ok else "FAIL"


# --------------------------------------------------------------------------- planning
def planning(stream: np.ndarray, other: np.ndarray) -> list[dict]:
    rows = []
    for cname, cost in COSTS.items():
        for k in KS:
            dp = plan_gears(stream, k, cost=cost, max_length=HIGH)
            p2 = power_of_two_gears(stream, k, cost=cost)
            oos = plan_gears(other, k, cost=cost, max_length=HIGH)
            rows.append(
                {
                    "cost": cname,
                    "k": k,
                    "planned": list(dp.sizes),
                    "programs": sum(c > 0 for c in dp.counts),
                    "overhead": dp.overhead,
                    "pow2": list(p2.sizes),
                    "pow2_overhead": p2.overhead,
                    "ratio": dp.overhead / p2.overhead,
                    "other_draw": list(oos.sizes),
                    "other_draw_overhead": fixed_gears(oos.sizes, stream, cost=cost).overhead,
                    "pad_all_overhead": fixed_gears([HIGH], stream, cost=cost).overhead,
                }
            )
    return rows


def planning_table(rows: list[dict], distinct: int) -> str:
    head = ["cost", "k", "planned gears", "programs (<= k)", "overhead", "powers of two",
            "overhead", "ratio (<= 0.5)", "planned on another draw: overhead"]  # fmt: skip
    body = [
        [
            r["cost"],
            r["k"],
            ", ".join(map(str, r["planned"])),
            f"{r['programs']} vs {distinct} {mark(r['programs'] <= r['k'])}",
            f"{r['overhead']:.3f}",
            ", ".join(map(str, r["pow2"])),
            f"{r['pow2_overhead']:.3f}",
            f"{r['ratio']:.2f} {mark(r['ratio'] <= TARGETS['ratio'])}",
            f"{r['other_draw_overhead']:.3f}",
        ]
        for r in rows
    ]
    return markdown_table(head, body)


# --------------------------------------------------------------------------- gradients
def _rel_l2(a, b) -> float:
    num = sum(float(np.sum((np.asarray(x) - np.asarray(y)) ** 2)) for x, y in zip(a, b))
    den = sum(float(np.sum(np.asarray(y) ** 2)) for y in b)
    return (num / den) ** 0.5


def gradients(stream: np.ndarray, gears, count: int) -> list[dict]:
    """Padded against unpadded gradients of the GPT loss for ``count`` stream batches."""
    params = models.init_gpt(jax.random.key(0), CFG)
    grad = jax.jit(jax.grad(models.gpt_loss), static_argnums=3)
    rows, seen = [], set()
    for i, length in enumerate(stream):
        length = int(length)
        gear = gears.gear_for(length)
        if gear == length or length in seen:
            continue
        seen.add(length)
        tokens, targets = batch_data(i, length)
        (pt, pg), w = pad_to_gear((tokens, targets), gear)
        g_pad = jax.tree.leaves(grad(params, pt, pg, CFG, w))
        g = jax.tree.leaves(grad(params, tokens, targets, CFG))
        rows.append({"length": length, "gear": gear, "rel_l2": _rel_l2(g_pad, g)})
        if len(rows) == count:
            break
    return rows


# --------------------------------------------------------------------------- wall time
def batch_data(i: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Batch ``i`` of the stream: tokens and next-token targets ``[B, length]`` (host)."""
    x = np.random.default_rng((2, i)).integers(0, CFG.vocab, (BATCH, length + 1), np.int32)
    return x[:, :-1], x[:, 1:]


def make_step(opt):
    """A fresh jitted Adam step ``step(state, batch, weights)`` (no shared jit caches)."""

    def step(state, batch, weights):
        params, opt_state = state
        loss, grads = jax.value_and_grad(models.gpt_loss)(params, batch[0], batch[1], CFG, weights)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return jax.jit(step)


def wall_time(stream: np.ndarray, strategies: dict, n_all: int, n_padded: int) -> dict:
    """Runs the strategies interleaved over the stream; per strategy, times and counts."""
    opt = optax.adam(1e-3)
    params = models.init_gpt(jax.random.key(0), CFG)
    steps = {name: geared(make_step(opt), gears) for name, gears in strategies.items()}
    strategies_sizes = {name: run.sizes for name, run in steps.items()}
    state = {name: (params, opt.init(params)) for name in strategies}
    rec = {name: {"s": [], "compile_s": [], "flops": 0.0, "n_first": 0} for name in strategies}
    names = list(strategies)
    for i in range(max(n_all, n_padded)):
        length = int(stream[i])
        batch = batch_data(i, length)
        active = [n for n in names if i < (n_all if n == "no bucketing" else n_padded)]
        shift = i % len(active)
        for name in active[shift:] + active[:shift]:  # rotate the order every batch
            run, r = steps[name], rec[name]
            before = run.compiled
            t0 = time.perf_counter()
            state[name], loss = run(state[name], batch)
            jax.block_until_ready(loss)
            dt = time.perf_counter() - t0
            r["s"].append(dt)
            if run.compiled > before:
                r["compile_s"].append(dt)
            r["flops"] += gpt_flops(length)
            if i + 1 == n_all:  # the figures over the first n_all batches
                r["first"] = {
                    "s": sum(r["s"]),
                    "compile_s": sum(r["compile_s"]),
                    "programs": run.compiled,
                    "overhead": run.overhead,
                    "flops": r["flops"],
                }
        if (i + 1) % 50 == 0 or i + 1 == n_all:
            print(f"  batch {i + 1}: " + ", ".join(
                f"{n} {sum(rec[n]['s']):.1f} s / {steps[n].compiled} programs" for n in active
            ), flush=True)  # fmt: skip
    out = {}
    for name in names:
        r, run = rec[name], steps[name]
        out[name] = {
            "gears": list(run.sizes) if len(run.sizes) <= 8 else f"{len(run.sizes)} lengths",
            "first": r["first"],
            "all": {
                "batches": len(r["s"]),
                "s": sum(r["s"]),
                "compile_s": sum(r["compile_s"]),
                "programs": run.compiled,
                "overhead": run.overhead,
                "flops": r["flops"],
            },
            "median_compile_s": statistics.median(r["compile_s"]) if r["compile_s"] else 0.0,
            # Programs over the whole stream, from the gears alone: the gears some length uses.
            "stream_programs": len(np.unique(np.searchsorted(strategies_sizes[name], stream))),
            "stream_flops": sum(gpt_flops(x) for x in stream),
        }
    return out


def wall_table(res: dict, n_all: int, ceiling: float, whole_run: bool) -> str:
    """One row per strategy: the first ``n_all`` batches, then the whole stream."""
    first = {n: r["first"]["s"] for n, r in res.items()}
    nob = res["no bucketing"]
    # No bucketing over the whole stream is bounded below by its compiles alone.
    nob_bound = nob["stream_programs"] * nob["median_compile_s"]
    whole = {n: r["all"]["s"] for n, r in res.items() if n != "no bucketing"}
    judged = ({**whole, "no bucketing": nob_bound} if whole_run else first).copy()
    basis = "whole stream" if whole_run else f"first {n_all}"
    head = ["strategy", "gears", f"first {n_all}: programs", "padding overhead",
            "s (compiles s)", "vs pad to 512", "whole stream: programs", "s (compiles s)",
            "vs pad to 512", f"faster than both ({basis})",
            f"useful GFLOP/s, {basis} (of ceiling)"]  # fmt: skip
    rows = []
    for name, r in res.items():
        f, a = r["first"], r["all"]
        if not whole_run:
            w_s, w_ratio = "not run", "-"
            gflops = f["flops"] / f["s"] / 1e9
        elif name == "no bucketing":
            w_s = f">= {nob_bound:.0f} (compiles alone)"
            w_ratio = f">= {nob_bound / whole['pad to 512']:.1f}"
            gflops = r["stream_flops"] / nob_bound / 1e9
        else:
            w_s = f"{a['s']:.1f} ({a['compile_s']:.1f})"
            w_ratio = f"{a['s'] / whole['pad to 512']:.2f}"
            gflops = a["flops"] / a["s"] / 1e9
        faster = "-"
        if name.startswith("planned"):
            faster = mark(all(judged[name] < judged[b] for b in ("pad to 512", "no bucketing")))
        bound = "<= " if whole_run and name == "no bucketing" else ""
        rows.append(
            [
                name,
                ", ".join(map(str, r["gears"])) if isinstance(r["gears"], list) else r["gears"],
                f["programs"],
                f"{f['overhead']:.3f}",
                f"{f['s']:.1f} ({f['compile_s']:.1f})",
                f"{f['s'] / first['pad to 512']:.2f}",
                r["stream_programs"],
                w_s,
                w_ratio,
                faster,
                f"{bound}{gflops:.1f} ({gflops / ceiling:.1%})",
            ]
        )
    return markdown_table(head, rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="15 timed batches, 2 gradient checks")
    p.add_argument(
        "--batches", type=int, default=None, help="batches timed for all four strategies (100)"
    )
    a = p.parse_args(argv)
    n_all = a.batches or (15 if a.quick else 100)
    n_padded = n_all if a.quick else STREAM
    t_start = time.perf_counter()
    stream, other = draw(0), draw(1)
    distinct = len(np.unique(stream))
    print(
        f"stream: {STREAM} lengths, median {np.median(stream):.0f}, mean {stream.mean():.0f}, "
        f"{distinct} distinct, {np.mean(stream == HIGH):.1%} at {HIGH}",
        flush=True,
    )
    plan = planning(stream, other)
    t_plan = planning_table(plan, distinct)
    print(t_plan, flush=True)

    gears = {k: plan_gears(stream, k, cost=gpt_flops, max_length=HIGH) for k in KS}
    grads = gradients(stream, gears[4], 2 if a.quick else 4)
    grad_rows = [
        [g["length"], g["gear"], f"{g['rel_l2']:.1e} {mark(g['rel_l2'] <= TARGETS['grad_rel'])}"]
        for g in grads
    ]
    t_grad = markdown_table(["length", "padded to", "grad rel L2 error (<= 1e-5)"], grad_rows)
    print(t_grad, flush=True)

    ceiling = matmul_ceiling()
    strategies = {
        "planned k=4": gears[4],
        "planned k=8": gears[8],
        "pad to 512": [HIGH],
        "no bucketing": sorted(int(x) for x in np.unique(stream)),
    }
    print(f"timing {n_all} batches (padded strategies: {n_padded})", flush=True)
    wall = wall_time(stream, strategies, n_all, n_padded)
    ceiling = max(ceiling, matmul_ceiling())
    t_wall = wall_table(wall, n_all, ceiling, n_padded > n_all)

    command = "PYTHONPATH=. python benchmarks/dynamic.py" + (" --quick" if a.quick else "")
    if a.batches:
        command += f" --batches {a.batches}"
    pad_all = {r["cost"]: r["pad_all_overhead"] for r in plan if r["k"] == KS[0]}
    table = "\n\n".join(
        [
            f"# Variable-length training with gears\n\nCommand: `{command}`; "
            f"{jax.default_backend()}, jax {jax.__version__}, shared 2-core CPU. Stream: "
            f"{STREAM} batch lengths, log-normal (median {MEDIAN}, sigma {SIGMA}) rounded "
            f"and clipped to [{LOW}, {HIGH}], `numpy.random.default_rng(0)`: median "
            f"{np.median(stream):.0f}, {distinct} distinct lengths (the programs without "
            f"bucketing). GPT L={CFG.layers} D={CFG.width} N={CFG.heads} V={CFG.vocab}, "
            f"seq_len {CFG.seq_len}, batch {BATCH}. Matmul ceiling {ceiling:.0f} GFLOP/s "
            "(f32 2048^3, best of a measure before and after).",
            "## Planned gears against powers of two\n\nOverhead: padded cost / unpadded "
            "cost - 1 over the whole stream; programs: gears that some batch of the stream "
            "uses. Padding everything to 512: overhead "
            + ", ".join(f"{v:.3f} ({c})" for c, v in pad_all.items())
            + ".\n\n"
            + t_plan,
            "## Gradients on padded batches\n\nGPT loss (`cannjax.models.gpt_loss`) with "
            "the per-token weights of `pad_to_gear`, padded to the k = 4 gear (GPT-FLOP "
            "cost), against the unpadded batch; relative L2 error over all parameters.\n\n"
            + t_grad,
            f"## Wall time of training steps, compiles included\n\nAdam steps of the GPT "
            f"over the first {n_all} batches of the stream, the four strategies interleaved "
            "batch by batch in one process, one round; planned gears use the GPT-FLOP "
            "cost. Compiles s: the first call of each program (trace, compile, one step). "
            "Useful GFLOP/s: the matmul FLOPs of the unpadded batches over the wall time. "
            "Whole stream: the padded strategies continued to the end of the stream"
            + ("" if n_padded > n_all else " (not run in --quick)")
            + "; programs there follow from the gears; no bucketing is bounded below by "
            "its compiles alone (distinct lengths x its median compile).\n\n" + t_wall,
        ]
    )
    payload = {
        "command": command,
        "stream": {"lengths": stream.tolist(), "distinct": distinct, "seed": 0},
        "model": dataclasses.asdict(CFG) | {"batch": BATCH},
        "targets": TARGETS,
        "planning": plan,
        "gradients": grads,
        "wall": wall,
        "batches_timed": n_all,
        "matmul_ceiling_gflops": ceiling,
        "run_s": time.perf_counter() - t_start,
    }
    write_results("dynamic", payload, table)
    print(table)
    print(f"({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
