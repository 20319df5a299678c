"""Reductions, losses and safe ops: fwd+bwd time and residual bytes against plain JAX.

For each op, the jitted ``value_and_grad`` of ``sum(op(args) * w)`` (``w`` a fixed random
cotangent) of the cannjax op and of its plain-JAX reference (the registry's ``reference``)
are timed in one process, interleaved A B A B after warm-up; we report the median ratio
(cannjax / plain, < 1 is faster) with the spread of the per-pair ratios (25th-75th
percentile), and the residual bytes of both (``cannjax.inspect.residuals``) plus the
compiled temp memory of the gradient program.

Run: ``PYTHONPATH=. python benchmarks/reductions.py [--quick] [--full]``. Writes
``reductions.json`` and ``.md``
to the results folder (``build/bench/results/``, or ``benchmarks/results/`` under
``cannjax bench --write``: see ``benchmarks/_harness.py``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _harness import RESULTS, interleaved_times  # noqa: E402

import cannjax  # noqa: E402
from cannjax.core import registry  # noqa: E402
from cannjax.inspect import compiled_memory, residuals  # noqa: E402


def _cases(shape, full):
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], shape) * 3
    y = jax.random.uniform(k[1], shape, minval=0.05, maxval=2.0)
    mask = jax.random.bernoulli(k[2], 0.8, shape)
    labels = jax.random.randint(k[3], shape[:-1], 0, shape[-1])
    p = jax.nn.softmax(x)
    cases = [
        ("logsumexp", (x,), {"axis": -1}, (0,)),
        ("logsumexp", (x,), {"axis": -1, "where": mask}, (0,)),
        ("softmax", (x,), {}, (0,)),
        ("softmax", (x,), {"where": mask}, (0,)),
        ("log_softmax", (x,), {}, (0,)),
        ("log_softmax", (x,), {"where": mask}, (0,)),
        ("softmax_cross_entropy", (x, labels), {}, (0,)),
        ("norm", (x,), {}, (0,)),
        ("normalize", (x,), {}, (0,)),
        ("cosine_similarity", (x, y), {}, (0, 1)),
        ("xlogy", (x, y), {}, (0, 1)),
        ("entropy", (p,), {}, (0,)),
        ("arctan2", (x, y), {}, (0, 1)),
    ]
    if full:
        shape2 = (4096, 32768)
        logits = jax.random.normal(k[0], shape2)
        lab = jax.random.randint(k[3], shape2[:-1], 0, shape2[-1])
        cases.append(("softmax_cross_entropy", (logits, lab), {}, (0,)))
    return cases


def _loss(fn, args, cfg, argnums):
    out_shape = jax.eval_shape(lambda *a: fn(*a, **cfg), *args).shape
    w = jax.random.normal(jax.random.key(7), out_shape)

    def loss(*diff):
        full = list(args)
        for i, d in zip(argnums, diff):
            full[i] = d
        return jnp.sum(fn(*full, **cfg) * w)

    return loss


def bench(name, args, cfg, argnums, reps):
    spec = registry()[name]
    diff = tuple(args[i] for i in argnums)
    ours_loss = _loss(spec.fn, args, cfg, argnums)
    ref_loss = _loss(spec.reference, args, cfg, argnums)
    nums = tuple(range(len(diff)))
    ours = jax.jit(jax.value_and_grad(ours_loss, argnums=nums))
    ref = jax.jit(jax.value_and_grad(ref_loss, argnums=nums))
    t_ours, t_ref = interleaved_times(
        [lambda: ours(*diff), lambda: ref(*diff)], repeats=reps, warmup=3, samples=True
    )
    ta, tb = t_ours["samples_s"], t_ref["samples_s"]
    ratios = np.asarray(ta) / np.asarray(tb)
    r_ours, r_ref = residuals(ours_loss, *diff), residuals(ref_loss, *diff)
    m_ours = compiled_memory(jax.grad(ours_loss, argnums=nums), *diff)
    m_ref = compiled_memory(jax.grad(ref_loss, argnums=nums), *diff)
    label = name + ("[where]" if "where" in cfg else "")
    return {
        "op": label,
        "shape": list(args[0].shape),
        "ms_cannjax": float(np.median(ta) * 1e3),
        "ms_plain": float(np.median(tb) * 1e3),
        "time_ratio": float(np.median(ratios)),
        "ratio_p25": float(np.percentile(ratios, 25)),
        "ratio_p75": float(np.percentile(ratios, 75)),
        "residual_bytes_cannjax": r_ours.total_bytes,
        "residual_bytes_plain": r_ref.total_bytes,
        "temp_bytes_cannjax": m_ours.temp_bytes,
        "temp_bytes_plain": m_ref.temp_bytes,
        "reps": reps,
    }


def _markdown(rows, cmd):
    lines = [
        f"Command: `{cmd}` ({platform.machine()}, jax {jax.__version__}, "
        f"{jax.devices()[0].platform}). fwd+bwd (jitted value_and_grad), interleaved "
        "medians; ratio = cannjax / plain JAX (p25-p75 of per-pair ratios).",
        "",
        "| op | shape | cannjax ms | plain ms | time ratio (p25-p75) | residual bytes "
        "cannjax / plain | temp bytes cannjax / plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['shape']} | {r['ms_cannjax']:.3f} | {r['ms_plain']:.3f} | "
            f"{r['time_ratio']:.2f} ({r['ratio_p25']:.2f}-{r['ratio_p75']:.2f}) | "
            f"{r['residual_bytes_cannjax']:,} / {r['residual_bytes_plain']:,} | "
            f"{r['temp_bytes_cannjax']:,} / {r['temp_bytes_plain']:,} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--full", action="store_true", help="add cross-entropy [4096, 32768]")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--no-write", action="store_true")
    a = parser.parse_args(argv)
    reps = a.reps or (10 if a.quick else 30)
    rows = []
    for name, args, cfg, argnums in _cases((256, 1024), a.full):
        r = bench(name, args, cfg, argnums, reps if args[0].size < 1e7 else max(10, reps // 3))
        rows.append(r)
        print(
            f"{r['op']:26s} {str(r['shape']):14s} ratio {r['time_ratio']:.2f} "
            f"({r['ratio_p25']:.2f}-{r['ratio_p75']:.2f})  residual "
            f"{r['residual_bytes_cannjax']:,} / {r['residual_bytes_plain']:,}  temp "
            f"{r['temp_bytes_cannjax']:,} / {r['temp_bytes_plain']:,}",
            flush=True,
        )
    cmd = (
        "PYTHONPATH=. python benchmarks/reductions.py"
        + (" --quick" if a.quick else "")
        + (" --full" if a.full else "")
    )
    if not a.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        payload = {"command": cmd, "jax": jax.__version__, "cannjax": cannjax.__version__}
        payload["rows"] = rows
        (RESULTS / "reductions.json").write_text(json.dumps(payload, indent=1) + "\n")
        (RESULTS / "reductions.md").write_text(_markdown(rows, cmd))
    return rows


if __name__ == "__main__":
    main()
