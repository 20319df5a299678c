"""``cannjax.optimize`` on transformer code from libraries nobody here wrote.

Run: ``PYTHONPATH=. python benchmarks/optimize_corpus.py [--quick] [--models NAME,...]
[--set heldout]``
(``--quick``: the small size only, no step times; the libraries come with the ``models``
extra: ``pip install -e ".[models]"``).

Each model of ``benchmarks/corpus`` (penzai, haliax, Hugging Face transformers' Flax
models, flax.nnx, equinox: see that package), or with ``--set heldout`` of
``benchmarks/heldout`` (dm-haiku, Keras 3, flax.linen: models no finder was written
against; results in ``optimize_heldout``), is optimized against itself unoptimized, in
one process, at the small size and at the realistic one (4 layers, width 512, T=1024,
batch 4, vocab 8192). Per model:

- found / present per kind: what :func:`cannjax.inspect.optimize` replaced against what
  the architecture holds (``corpus.Model.present``); a ``linear_cross_entropy`` loss
  counts its head as a found projection too;
- the equations left alone, grouped by reason;
- gradients: max over arrays of ``max |a - b| / max |b|`` against the unoptimized step
  (:func:`grad_rel`: each array against at least 1e-2 of the largest gradient, since
  one that is zero in exact arithmetic, the key bias, holds only rounding);
- compiled temp memory of ``jax.jit(jax.value_and_grad(loss))``, optimized / plain;
- step time of that step (realistic size only): medians of interleaved runs after warm-up,
  optimized / plain (this machine's f32 matmul ceiling is recorded beside it).

Targets (issue 24): found / present >= 95% for attention, norms and projections in every
model, losses and activations all found; gradients equal to 1e-5; at the realistic size,
temp <= 0.6x and time <= 0.8x.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402
import heldout  # noqa: E402
from _harness import interleaved_times, markdown_table, write_results  # noqa: E402

import cannjax  # noqa: E402

TARGETS = {"found": 0.95, "grad": 1e-5, "temp": 0.6, "time": 0.8}


def found(report) -> dict[str, int]:
    """Replacements per corpus kind, each counted as often as it runs (a scanned layer's
    once per layer); a fused head-and-loss also counts as a projection, a gated MLP as its
    three projections and its activation, and an attention or
    loss that soft-caps its logits (``logit_cap``) also counts that cap."""
    out = dict.fromkeys(corpus.KINDS, 0)
    for r in report.replaced:
        if r.kind in out:
            out[r.kind] += r.runs
        if r.op == "linear_cross_entropy":
            out["dense"] += r.runs
        if r.kind == "gated":  # gate, up and down projections and the activation
            out["dense"] += 3 * r.runs
            out["activation"] += r.runs
        if "soft-capped" in r.source:  # attention's or the loss's logits
            out["activation"] += r.runs
    return out


def left_reasons(report) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in report.left:
        out[r.source] = out.get(r.source, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# A gradient that is zero in exact arithmetic (the key projection's bias, which the
# softmax cancels) holds only rounding, 1e-9 where the others are 1e-1: its relative
# difference is noise over noise. So every array is measured against at least this
# fraction of the largest gradient.
ZERO_GRADIENT = 1e-2


def grad_rel(a, b) -> float:
    """Max over arrays of ``max |a - b| / max(max |b|, ZERO_GRADIENT * largest |b|)``
    (``b`` the reference)."""
    leaves = list(zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    largest = max((float(jnp.max(jnp.abs(y))) for _, y in leaves), default=0.0)
    rel = 0.0
    for x, y in leaves:
        scale = max(float(jnp.max(jnp.abs(y))), ZERO_GRADIENT * largest) or 1.0
        rel = max(rel, float(jnp.max(jnp.abs(x - y))) / scale)
    return rel


def measure(model: corpus.Model, size: corpus.Size, timed: bool, repeats: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    params, batch, loss = model.build(size, 0)
    opt = cannjax.optimize(loss)
    report = cannjax.inspect.optimize(loss, params, batch)
    present = model.present(size)
    got = found(report)
    steps = {
        name: jax.jit(jax.value_and_grad(f)) for name, f in (("plain", loss), ("optimize", opt))
    }
    compiled = {k: s.lower(params, batch).compile() for k, s in steps.items()}
    temp = {k: int(c.memory_analysis().temp_size_in_bytes) for k, c in compiled.items()}
    grads = {k: c(params, batch)[1] for k, c in compiled.items()}
    out: dict[str, Any] = {
        "library": model.library,
        "features": list(model.features),
        "present": present,
        "found": got,
        "left": left_reasons(report),
        "grad_rel": grad_rel(grads["optimize"], grads["plain"]),
        "temp_bytes": temp,
        "temp_ratio": temp["optimize"] / temp["plain"],
    }
    if timed:
        runs = [lambda c=c: c(params, batch) for c in compiled.values()]
        times = dict(zip(compiled, interleaved_times(runs, repeats=repeats)))
        out["time_s"] = {k: v["median_s"] for k, v in times.items()}
        out["iqr_rel"] = {k: v["iqr_rel"] for k, v in times.items()}
        out["time_ratio"] = out["time_s"]["optimize"] / out["time_s"]["plain"]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"{model.name} ({size.width}): {out['seconds']} s", flush=True)
    return out


def summed(rows: dict[str, Any]) -> str:
    """The models' compiled temp and step times summed, optimized / plain."""

    def ratio(key: str) -> float:
        got = [m[key] for m in rows.values()]
        return sum(g["optimize"] for g in got) / sum(g["plain"] for g in got)

    return (
        f"Summed over the models, optimized / plain: compiled temp {ratio('temp_bytes'):.2f}x, "
        f"step time {ratio('time_s'):.2f}x."
    )


def markdown(res: dict[str, Any]) -> str:
    parts = []
    sizes = {n: res["sizes"][n] for n in corpus.SIZES if n in res["sizes"]}  # small first
    for size_name, rows in sizes.items():
        head = ["model", "library", *corpus.KINDS, "grad rel.", "temp x", "time x"]
        table = []
        totals = {k: [0, 0] for k in corpus.KINDS}
        for name, m in rows.items():
            cells = []
            for k in corpus.KINDS:
                f, p = m["found"][k], m["present"][k]
                totals[k][0] += f
                totals[k][1] += p
                cells.append(f"{f}/{p}" if p or f else "-")
            time_x = f"{m['time_ratio']:.2f}" if "time_ratio" in m else ""
            table.append([name, m["library"], *cells, f"{m['grad_rel']:.1e}",
                          f"{m['temp_ratio']:.2f}", time_x])  # fmt: skip
        table.append(["all", "", *(f"{f}/{p}" for f, p in totals.values()), "", "", ""])
        parts.append(
            f"Size `{size_name}` (found / present per kind):\n\n" + markdown_table(head, table)
        )
        if all("time_s" in m for m in rows.values()):
            parts.append(summed(rows))
    reasons: dict[str, int] = {}
    for rows in sizes.values():
        for m in rows.values():
            for why, n in m["left"].items():
                reasons[why] = reasons.get(why, 0) + n
        break  # the small size's reasons (the realistic one's are the same equations)
    if reasons:
        parts.append(
            "Equations left alone at the small size, by reason:\n\n"
            + markdown_table(["equations", "reason"], [[n, why] for why, n in reasons.items()])
        )
    else:
        parts.append("No equation that looked like part of an idiom was left alone.")
    if res.get("matmul_ceiling_gflops"):
        parts.append(
            f"Step times: medians of interleaved runs; this machine's f32 matmul ceiling "
            f"{res['matmul_ceiling_gflops']:.0f} GFLOP/s."
        )
    return "\n\n".join(parts)


def main(argv=None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the small size only, untimed")
    p.add_argument("--models", default="", help="comma-separated names (default: all)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved timed rounds")
    p.add_argument(
        "--set",
        choices=("corpus", "heldout"),
        default="corpus",
        help="benchmarks/corpus (default) or benchmarks/heldout, the models no finder saw",
    )
    a = p.parse_args(argv)
    models = corpus.models() if a.set == "corpus" else heldout.models()
    if a.models:
        models = {n: models[n] for n in a.models.split(",")}
    sizes = ("small",) if a.quick else ("small", "realistic")
    res: dict[str, Any] = {"targets": TARGETS, "sizes": {}}
    for size_name in sizes:
        timed = size_name == "realistic"
        res["sizes"][size_name] = {
            n: measure(m, corpus.SIZES[size_name], timed, a.repeats) for n, m in models.items()
        }
    if not a.quick:
        from gpt import matmul_ceiling  # noqa: PLC0415

        res["matmul_ceiling_gflops"] = matmul_ceiling()
    command = "PYTHONPATH=. python benchmarks/optimize_corpus.py" + " --quick" * a.quick
    if a.models:
        command += f" --models {a.models}"
    if a.repeats != 5:
        command += f" --repeats {a.repeats}"
    if a.set != "corpus":
        command += f" --set {a.set}"
    table = markdown(res)
    print(table)
    name = "optimize_corpus" if a.set == "corpus" else "optimize_heldout"
    write_results(name, {"command": command, **res}, table)
    return res


if __name__ == "__main__":
    main()
