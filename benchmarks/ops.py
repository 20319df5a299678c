"""Every registered operator against its plain-JAX reference: fwd+bwd time and residuals.

Run: ``PYTHONPATH=. python benchmarks/ops.py [--quick] [--only NAME ...]``

For each operator and config, both the cannjax op and plain autodiff of its reference run
``jax.jit(lambda x, g: jax.vjp(f, *x)[1](g))`` (forward and backward), interleaved; the
table gives the time ratio (cannjax / plain, median of interleaved runs) and residual
bytes of each (``cannjax.inspect.residuals``, arguments included). Operators whose sample
accepts ``shape=`` are measured at ``--shape`` (default 2048 x 1024 float32).
"""

from __future__ import annotations

import argparse
import functools
import inspect as pyinspect
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from _harness import interleaved_times, markdown_table, write_results  # noqa: E402

import cannjax  # noqa: E402
from cannjax.inspect import residuals  # noqa: E402


def _args(spec, shape):
    key = jax.random.key(0)
    if "shape" in pyinspect.signature(spec.sample).parameters:
        return spec.sample(key, shape=shape)
    return spec.sample(key)


def _fwd_bwd(f, nondiff):
    def run(args, g):
        diff = [i for i in range(len(args)) if i not in nondiff]

        def part(*d):
            full = list(args)
            for i, v in zip(diff, d):
                full[i] = v
            return f(*full)

        return jax.vjp(part, *(args[i] for i in diff))[1](g)

    return jax.jit(run)


def bench_op(spec, cfg, shape, repeats):
    args = tuple(_args(spec, shape))
    ours = functools.partial(spec.fn, **cfg)
    ref = functools.partial(spec.reference, **cfg)
    out = ours(*args)
    g = jax.tree_util.tree_map(jnp.ones_like, out)
    f_ours, f_ref = _fwd_bwd(ours, spec.nondiff_argnums), _fwd_bwd(ref, spec.nondiff_argnums)
    t_ours, t_ref = interleaved_times(
        [lambda: f_ours(args, g), lambda: f_ref(args, g)], repeats=repeats
    )

    def loss(f):
        return lambda *a: jnp.sum(jnp.asarray(f(*a), jnp.float32))

    r_ours = residuals(loss(ours), *args)
    r_ref = residuals(loss(ref), *args)
    return {
        "op": spec.name,
        "config": cfg,
        "shapes": [list(jnp.shape(a)) for a in args],
        "ours_ms": 1e3 * t_ours["median_s"],
        "ref_ms": 1e3 * t_ref["median_s"],
        "ratio": t_ours["median_s"] / t_ref["median_s"],
        "spread": max(t_ours["iqr_rel"], t_ref["iqr_rel"]),
        "residual_bytes": r_ours.total_bytes,
        "ref_residual_bytes": r_ref.total_bytes,
        "residual_count": r_ours.count,
        "ref_residual_count": r_ref.count,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller arrays, fewer repeats")
    p.add_argument("--only", nargs="*", default=None, help="operator names")
    p.add_argument("--repeats", type=int, default=None)
    a = p.parse_args(argv)
    shape = (256, 256) if a.quick else (2048, 1024)
    repeats = a.repeats or (7 if a.quick else 21)
    rows, table = [], []
    for name, spec in sorted(cannjax.core.registry().items()):
        if a.only and name not in a.only:
            continue
        for cfg in spec.configs:
            r = bench_op(spec, dict(cfg), shape, repeats)
            rows.append(r)
            label = name + "".join(f" {k}={v}" for k, v in cfg.items())
            table.append(
                [
                    label,
                    f"{r['ours_ms']:.2f}",
                    f"{r['ref_ms']:.2f}",
                    f"{r['ratio']:.2f}",
                    f"{r['spread']:.0%}",
                    f"{r['residual_count']} / {r['residual_bytes']:,}",
                    f"{r['ref_residual_count']} / {r['ref_residual_bytes']:,}",
                ]
            )
            print(" | ".join(table[-1]), flush=True)
    md = markdown_table(
        [
            "op",
            "cannjax ms",
            "plain ms",
            "ratio",
            "spread",
            "residuals (n / bytes)",
            "plain residuals (n / bytes)",
        ],
        table,
    )
    write_results(
        "ops" + ("_quick" if a.quick else ""),
        {"shape": list(shape), "repeats": repeats, "rows": rows},
        md,
    )
    print(md)
    worse = [r["op"] for r in rows if r["residual_bytes"] > r["ref_residual_bytes"]]
    if worse:
        print(f"saves more residual bytes than plain JAX: {worse}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
