"""Remat schedules and the planner on a deep activation-heavy MLP, side by side.

The chain: ``h <- h + tanh(h @ w_i)`` for 64 stacked layers (width 512, batch 2048;
``--quick``: 32 layers, width 128, batch 256). Gradient of ``sum(h**2)`` with respect to
the weights and the input. For each candidate: compiled temp memory
(``memory_analysis().temp_size_in_bytes``) and wall time (one process, interleaved
A B A B after warm-up, median and spread), as a ratio to the plain scan.

Run: ``PYTHONPATH=. python benchmarks/remat.py [--quick] [--repeats N]``. Writes
``remat{_quick}.json``, ``.md`` and ``.png``
to the results folder (``build/bench/results/``, or ``benchmarks/results/`` under
``cannjax bench --write``: see ``benchmarks/_harness.py``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
from _harness import RESULTS

import cannjax
from cannjax.remat import revolve


def _body(h, w):
    return h + jnp.tanh(h @ w), None


def _grad(run):
    return jax.jit(jax.grad(lambda ws, h: jnp.sum(run(ws, h) ** 2), argnums=(0, 1)))


def _scan(schedule, c=None):
    return lambda ws, h: cannjax.remat.checkpointed_scan(
        _body, h, ws, schedule=schedule, checkpoints=c
    )[0]


def _equinox(c=None):
    import equinox.internal as eqxi

    return lambda ws, h: eqxi.scan(_body, h, ws, kind="checkpointed", checkpoints=c)[0]


def _interleaved(fns, repeats, warmup=1):
    for f in fns:
        for _ in range(warmup):
            jax.block_until_ready(f())
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for f, s in zip(fns, samples):
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            s.append(time.perf_counter() - t0)
    out = []
    for s in samples:
        med = statistics.median(s)
        q = statistics.quantiles(s, n=4) if len(s) > 1 else [med, med, med]
        out.append({"median_s": med, "iqr_rel": (q[2] - q[0]) / med, "n": len(s)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON")
    args = ap.parse_args()
    if args.plot_only:
        suffix = "_quick" if args.quick else ""
        _plot(
            json.loads((RESULTS / f"remat{suffix}.json").read_text()),
            RESULTS / f"remat{suffix}.png",
        )
        return
    n, width, batch = (32, 128, 256) if args.quick else (64, 512, 2048)
    repeats = args.repeats or (10 if args.quick else 10)
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    ws = jax.random.normal(k1, (n, width, width)) / width**0.5
    h = jax.random.normal(k2, (batch, width))
    c0 = revolve.default_checkpoints(n)

    cands = {
        "plain scan (none)": _scan("none"),
        "every": _scan("every"),
        "sqrt": _scan("sqrt"),
        f"binomial c={c0} (default)": _scan("binomial"),
        "binomial c=2": _scan("binomial", 2),
    }
    try:
        cands["equinox checkpointed (default)"] = _equinox()
        cands["equinox checkpointed c=2"] = _equinox(2)
    except ImportError:
        print("equinox not installed: skipping its rows")
    carry = batch * width * 4
    # The planner at budgets from its feasible minimum to the no-remat figure.
    top = cannjax.remat.plan(_body, h, ws, budget=2**40)
    lo, hi = top.minimum_bytes, top.no_remat_bytes
    plans = []
    for frac in (0.0, 0.15, 0.5):
        budget = int(lo + frac * (hi - lo))
        p = cannjax.remat.plan(_body, h, ws, budget=budget)
        plans.append((budget, p))
        cands[f"plan budget={budget / 2**20:.0f} MiB -> {p.schedule} c={p.checkpoints}"] = _scan(
            p.schedule, p.checkpoints
        )

    compiled, rows = {}, []
    for name, run in cands.items():
        compiled[name] = _grad(run).lower(ws, h).compile()
    mem = {k: int(c.memory_analysis().temp_size_in_bytes) for k, c in compiled.items()}
    times = _interleaved([lambda c=c: c(ws, h) for c in compiled.values()], repeats)
    base = times[0]["median_s"]
    g_ref = compiled["plain scan (none)"](ws, h)
    for (name, c), t in zip(compiled.items(), times):
        g = c(ws, h)
        err = max(
            float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref))
        )
        rows.append(
            {
                "name": name,
                "temp_mib": mem[name] / 2**20,
                "time_s": t["median_s"],
                "time_ratio": t["median_s"] / base,
                "iqr_rel": t["iqr_rel"],
                "max_rel_grad_diff": err,
            }
        )
    payload = {
        "machine": {
            "backend": jax.default_backend(),
            "jax": jax.__version__,
            "python": platform.python_version(),
        },
        "config": {
            "layers": n,
            "width": width,
            "batch": batch,
            "repeats": repeats,
            "carry_mib": carry / 2**20,
            "default_checkpoints": c0,
            "revolve_advances_default": revolve.advances(n, c0),
            "revolve_advances_c2": revolve.advances(n, 2),
        },
        "rows": rows,
        "plans": [
            {
                "budget_mib": b / 2**20,
                "schedule": p.schedule,
                "checkpoints": p.checkpoints,
                "compiled_mib": p.compiled_bytes / 2**20,
                "predicted_mib": p.predicted_bytes / 2**20,
                "compute_ratio": p.compute_ratio,
            }
            for b, p in plans
        ],
        "plan_range_mib": [lo / 2**20, hi / 2**20],
    }
    suffix = "_quick" if args.quick else ""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"remat{suffix}.json").write_text(json.dumps(payload, indent=1) + "\n")
    lines = [
        f"Remat, {n}-layer MLP h + tanh(h @ w), width {width}, batch {batch}: gradient of "
        f"sum(h**2). Median of {repeats} interleaved runs; spread = IQR / median.",
        "",
        "| candidate | temp MiB | time s | x plain | spread | max rel grad diff |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['temp_mib']:.1f} | {r['time_s']:.3f} | "
            f"{r['time_ratio']:.2f} | {r['iqr_rel']:.2f} | {r['max_rel_grad_diff']:.1e} |"
        )
    lines.append("")
    lines.append(
        f"Command: `PYTHONPATH=. python benchmarks/remat.py{' --quick' if args.quick else ''}`"
    )
    (RESULTS / f"remat{suffix}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(payload, RESULTS / f"remat{suffix}.png")


def _plot(payload, path):
    """Memory against time for every candidate (planner rows as squares)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullFormatter, ScalarFormatter
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    cfg = payload["config"]
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=90)
    for r in payload["rows"]:
        marker = "s" if r["name"].startswith("plan") else "o"
        ax.scatter(r["temp_mib"], r["time_ratio"], marker=marker)
        ax.annotate(
            r["name"].split(" -> ")[0],
            (r["temp_mib"], r["time_ratio"]),
            fontsize=6,
            xytext=(3, 2),
            textcoords="offset points",
        )
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("compiled temp memory of the gradient (MiB)")
    ax.set_ylabel("time / plain scan")
    ax.set_title(
        f"remat: {cfg['layers']} layers, width {cfg['width']}, batch {cfg['batch']}", fontsize=8
    )
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
