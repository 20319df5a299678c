"""``cannjax.optimize`` on transformer code from libraries nobody here wrote.

Run: ``PYTHONPATH=. python benchmarks/optimize_corpus.py [--quick] [--models NAME,...]
[--set heldout] [--compute bfloat16 [--recipe native]]``
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

With ``--compute bfloat16`` every model runs in mixed precision as its users can run it
(:func:`corpus.in_half_precision`: the float32 parameters cast to bfloat16 at the top of
the loss; results ``optimize_corpus_bf16`` / ``optimize_heldout_bf16``). A bfloat16
gradient differs from the unoptimized one by rounding, so both are measured against the
float32 model's gradient instead (:func:`half_accuracy`): the optimized step must be no
further from it than the plain half step, within what rounding allows. Models whose
library cannot run them so are listed with the reason (``corpus.HALF_UNSUPPORTED``).
With ``--recipe native`` the models instead take their library's own mixed-precision
setting (``corpus.Model.half_setting``: transformers' and flax's ``dtype=``, haiku's
policies, Keras' ``mixed_bfloat16``), which computes in bfloat16 where the library chose
to; results ``optimize_corpus_bf16_native`` / ``optimize_heldout_bf16_native``, the
libraries without such a setting listed as not run.

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

NO_SETTING = (
    "no mixed-precision setting in the library (its users cast the parameters, as the "
    "default recipe does)"
)


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


def grad_rels(a, b) -> list[float]:
    """Per array, ``max |a - b| / max(max |b|, ZERO_GRADIENT * largest |b|)`` (``b`` the
    reference), in float32."""
    leaves = [
        (jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    ]
    largest = max((float(jnp.max(jnp.abs(y))) for _, y in leaves), default=0.0)
    rels = []
    for x, y in leaves:
        scale = max(float(jnp.max(jnp.abs(y))), ZERO_GRADIENT * largest) or 1.0
        rels.append(float(jnp.max(jnp.abs(x - y))) / scale)
    return rels


def grad_rel(a, b) -> float:
    """Max over arrays of :func:`grad_rels`."""
    return max(grad_rels(a, b), default=0.0)


def half_accuracy(opt, plain, exact, dtype) -> dict[str, Any]:
    """How far the optimized and the plain half-precision gradients are from the float32
    model's (max over arrays of :func:`grad_rels`), and whether every array of the
    optimized one is within ``1.5 x`` the plain one's distance plus 2 ulp of ``dtype``
    (what rounding in that precision allows: tests/test_optimize_half.py's bound)."""
    eps = float(jnp.finfo(dtype).eps)
    e_opt, e_plain = grad_rels(opt, exact), grad_rels(plain, exact)
    return {
        "optimize": max(e_opt, default=0.0),
        "plain": max(e_plain, default=0.0),
        "within": all(o <= 1.5 * p + 2 * eps for o, p in zip(e_opt, e_plain)),
        "finite": all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(opt)),
    }


def _same_arrays(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x.dtype == y.dtype and bool(jnp.array_equal(x, y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def measure(
    model: corpus.Model,
    size: corpus.Size,
    timed: bool,
    repeats: int,
    compute: Any = None,
    native: bool = False,
) -> dict[str, Any]:
    """One model at one size; ``compute``: a half dtype to run it in, with its float32
    parameters cast in the loss (:func:`corpus.in_half_precision`) or, ``native``, with
    the library's own setting (``model.half_setting``); its gradients are then judged
    against the float32 model's (:func:`half_accuracy`)."""
    t0 = time.perf_counter()
    params, batch, wide_loss = model.build(size, 0)
    if compute is None:
        loss = wide_loss
    elif native:
        wide = params
        params, batch, loss = model.build(size, 0, compute=compute)
        if not _same_arrays(params, wide):  # the float32 model is the reference below
            raise ValueError(f"{model.name}: its half_setting build changed the parameters")
    else:
        loss = corpus.in_half_precision(wide_loss, compute)
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
    if compute is not None:
        exact = jax.jit(jax.grad(wide_loss))(params, batch)
        out["grad_err"] = half_accuracy(grads["optimize"], grads["plain"], exact, compute)
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
        half = any("grad_err" in m for m in rows.values())
        grad_head = "grad err. vs f32 (optimize / plain)" if half else "grad rel."
        head = ["model", "library", *corpus.KINDS, grad_head, "temp x", "time x"]
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
            grad = f"{m['grad_rel']:.1e}"
            if "grad_err" in m:
                e = m["grad_err"]
                grad = f"{e['optimize']:.1e} / {e['plain']:.1e}" + ("" if e["within"] else " (!)")
            table.append([name, m["library"], *cells, grad,
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
    if res.get("settings"):
        parts.append(
            f"Run in {res['compute']} with each library's own mixed-precision setting "
            "(float32 parameters):\n\n"
            + markdown_table(["model", "setting"], [[n, w] for n, w in res["settings"].items()])
        )
    if res.get("compute"):
        how = (
            "its library's setting"
            if res.get("settings")
            else "`corpus.in_half_precision`: float32 parameters cast at the top of the loss"
        )
        parts.append(
            f"Run in {res['compute']} ({how}). Gradients: max over arrays of each one's "
            "distance from the float32 model's gradient, optimized / plain. Every array of "
            "every model is checked against 1.5x the plain one's distance + 2 ulp; `(!)` "
            "marks a model with an array beyond it."
        )
        by_reason: dict[str, list[str]] = {}
        for name, why in res.get("skipped", {}).items():
            by_reason.setdefault(why, []).append(name)
        parts += [f"Not run: {', '.join(names)}, {why}." for why, names in by_reason.items()]
    ceilings = res.get("matmul_ceilings_gflops")
    if ceilings:
        parts.append(
            "Step times: medians of interleaved runs; this machine's matmul ceilings "
            f"(2048^3): float32 {ceilings['float32']:.0f}, bfloat16 x bfloat16 -> float32 "
            f"{ceilings['bfloat16']:.0f} GFLOP/s."
        )
    elif res.get("matmul_ceiling_gflops"):
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
    p.add_argument(
        "--compute",
        choices=("float32", "bfloat16"),
        default="float32",
        help="bfloat16: every model in mixed precision (float32 parameters cast in the "
        "loss; results optimize_corpus_bf16 / optimize_heldout_bf16)",
    )
    p.add_argument(
        "--recipe",
        choices=("cast", "native"),
        default="cast",
        help="with --compute: cast the parameters in the loss (default), or native: the "
        "library's own mixed-precision setting (results *_bf16_native)",
    )
    a = p.parse_args(argv)
    models = corpus.models() if a.set == "corpus" else heldout.models()
    if a.models:
        models = {n: models[n] for n in a.models.split(",")}
    half = a.compute != "float32"
    native = half and a.recipe == "native"
    if a.recipe == "native" and not half:
        p.error("--recipe native needs --compute bfloat16")
    compute = jnp.dtype(a.compute) if half else None
    if native:
        skipped = {n: NO_SETTING for n, m in models.items() if not m.half_setting}
    else:
        skipped = {
            n: corpus.HALF_UNSUPPORTED[n] for n in models if half and n in corpus.HALF_UNSUPPORTED
        }
    models = {n: m for n, m in models.items() if n not in skipped}
    sizes = ("small",) if a.quick else ("small", "realistic")
    res: dict[str, Any] = {"targets": TARGETS, "sizes": {}}
    if half:
        res.update(compute=a.compute, recipe=a.recipe, skipped=skipped)
    if native:
        res["settings"] = {n: m.half_setting for n, m in models.items()}
    for size_name in sizes:
        timed = size_name == "realistic"
        res["sizes"][size_name] = {
            n: measure(m, corpus.SIZES[size_name], timed, a.repeats, compute, native)
            for n, m in models.items()
        }
    if not a.quick:
        from gpt import matmul_ceilings  # noqa: PLC0415

        res["matmul_ceilings_gflops"] = matmul_ceilings()
        res["matmul_ceiling_gflops"] = res["matmul_ceilings_gflops"]["float32"]
    command = "PYTHONPATH=. python benchmarks/optimize_corpus.py" + " --quick" * a.quick
    if a.models:
        command += f" --models {a.models}"
    if a.repeats != 5:
        command += f" --repeats {a.repeats}"
    if a.set != "corpus":
        command += f" --set {a.set}"
    if half:
        command += f" --compute {a.compute}" + " --recipe native" * native
    table = markdown(res)
    print(table)
    name = ("optimize_corpus" if a.set == "corpus" else "optimize_heldout") + "_bf16" * half
    name += "_native" * native
    write_results(name, {"command": command, **res}, table)
    return res


if __name__ == "__main__":
    main()
