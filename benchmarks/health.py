"""Overhead of cannjax.health.grad_stats inside a jitted training step.

Model: an MLP of ``--layers`` gelu layers of width ``--width`` on ``--batch`` rows (2048
rows, as many tokens as the GPT benchmark's batch 8 x T 256), Adam. Baseline A: the
step; candidate B: the same step that also returns ``grad_stats(grads)``. One process,
interleaved A B A B after warm-up, ``jax.block_until_ready``, median of ``--reps`` runs.

Run: ``PYTHONPATH=. python benchmarks/health.py [--quick]``
Writes health.json and health.md
to the results folder (``build/bench/results/``, or ``benchmarks/results/`` under
``cannjax bench --write``: see ``benchmarks/_harness.py``).
"""

import argparse
import json
import pathlib
import platform
import statistics
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _harness import RESULTS, interleaved_times  # noqa: E402

from cannjax.health import grad_stats  # noqa: E402


def init(key, width, layers, d_in):
    params, sizes = [], [d_in] + [width] * layers
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        k = jax.random.fold_in(key, i)
        params.append({"w": jax.random.normal(k, (a, b)) / a**0.5, "b": jnp.zeros(b)})
    return params


def loss_fn(params, x, y):
    h = x
    for layer in params:
        h = jax.nn.gelu(h @ layer["w"] + layer["b"][None])
    return jnp.mean((h - y) ** 2)


def make_steps(opt):
    def base(params, state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        u, state = opt.update(g, state, params)
        return optax.apply_updates(params, u), state, loss

    def with_stats(params, state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        u, state = opt.update(g, state, params)
        return optax.apply_updates(params, u), state, loss, grad_stats(g)

    return jax.jit(base), jax.jit(with_stats)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    if args.quick:
        args.width, args.batch, args.reps = 256, 512, 10
    key = jax.random.key(0)
    params = init(key, args.width, args.layers, args.width)
    x = jax.random.normal(jax.random.fold_in(key, 99), (args.batch, args.width))
    y = jax.random.normal(jax.random.fold_in(key, 98), (args.batch, args.width))
    opt = optax.adam(1e-3)
    state = opt.init(params)
    base, cand = make_steps(opt)
    mem = {}
    for name, f in (("base", base), ("grad_stats", cand)):
        c = f.lower(params, state, x, y).compile()
        mem[name] = c.memory_analysis().temp_size_in_bytes
    # C: grad_stats alone on gradients already in memory (its cost with no fusion help).
    grads = jax.jit(jax.grad(loss_fn))(params, x, y)
    stats_only = jax.jit(grad_stats)
    ta, tb, tc = (
        r["samples_s"]
        for r in interleaved_times(
            [
                lambda: base(params, state, x, y),
                lambda: cand(params, state, x, y),
                lambda: stats_only(grads),
            ],
            repeats=args.reps,
            warmup=3,
            samples=True,
        )
    )
    ratios = sorted(b / a for a, b in zip(ta, tb))
    q = statistics.quantiles(ratios, n=4)
    n_params = sum(v.size for v in jax.tree.leaves(params))
    res = {
        "model": f"MLP {args.layers}x{args.width} gelu, batch {args.batch}, adam",
        "params": n_params,
        "leaves": len(jax.tree.leaves(params)),
        "reps": args.reps,
        "base_ms_median": 1e3 * statistics.median(ta),
        "grad_stats_ms_median": 1e3 * statistics.median(tb),
        "grad_stats_alone_ms_median": 1e3 * statistics.median(tc),
        "alone_over_step": statistics.median(tc) / statistics.median(ta),
        "ratio_of_medians": statistics.median(tb) / statistics.median(ta),
        "paired_ratio_median": statistics.median(ratios),
        "paired_ratio_iqr": [q[0], q[2]],
        "base_ms_iqr": [1e3 * v for v in statistics.quantiles(ta, n=4)[::2]],
        "grad_stats_ms_iqr": [1e3 * v for v in statistics.quantiles(tb, n=4)[::2]],
        "temp_bytes": mem,
        "target": "overhead <= 5% (paired ratio median <= 1.05)",
        "jax": jax.__version__,
        "machine": f"{platform.machine()} CPU, shared cores (noisy)",
        "command": "PYTHONPATH=. python benchmarks/health.py" + (" --quick" if args.quick else ""),
    }
    out = RESULTS
    out.mkdir(parents=True, exist_ok=True)
    (out / "health.json").write_text(json.dumps(res, indent=2) + "\n")
    md = [
        "# grad_stats overhead inside a jitted step",
        "",
        f"`{res['command']}`: {res['model']}, {n_params} parameters in {res['leaves']} leaves,"
        f" {args.reps} interleaved pairs (A = step, B = step + grad_stats).",
        "",
        "| variant | median ms | IQR ms | temp bytes |",
        "|---|---|---|---|",
        f"| step | {res['base_ms_median']:.2f} | {res['base_ms_iqr'][0]:.2f}-"
        f"{res['base_ms_iqr'][1]:.2f} | {mem['base']} |",
        f"| step + grad_stats | {res['grad_stats_ms_median']:.2f} | "
        f"{res['grad_stats_ms_iqr'][0]:.2f}-{res['grad_stats_ms_iqr'][1]:.2f} | "
        f"{mem['grad_stats']} |",
        "",
        f"Paired ratio B/A: median {res['paired_ratio_median']:.3f} (IQR "
        f"{q[0]:.3f}-{q[2]:.3f}); ratio of medians {res['ratio_of_medians']:.3f}. "
        "Target <= 1.05. grad_stats alone on the gradients (C): "
        f"{res['grad_stats_alone_ms_median']:.2f} ms median = "
        f"{100 * res['alone_over_step']:.1f}% of the step median. "
        "Shared 2-core machine: wall times are noisy.",
        "",
    ]
    (out / "health.md").write_text("\n".join(md))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
