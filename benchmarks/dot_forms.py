"""Matrix-product forms: this machine's ceilings, and every dot of the bf16 GPT step.

Run: ``PYTHONPATH=. python benchmarks/dot_forms.py [--quick | --smoke] [--tag TAG]``

Part 1, the ceilings: each dot form a training step uses (``x @ w``; ``x @ w^T``; the
weight gradient ``x^T g``, contracting the token axis; batched ``q k^T``, ``p v`` and
``p^T do``), alone in a jitted function, in float32, bfloat16 -> bfloat16 and
bfloat16 x bfloat16 -> float32 (``preferred_element_type``), and as cannjax's dot table
runs it for bfloat16 (:mod:`cannjax._src.core.dots`), GFLOP/s, the forms of one shape
interleaved. Which of them reach the machine's bf16 units differs by CPU (AMX, AVX512-BF16,
none): the table is the one to read before choosing a form.

Part 2, the step: every ``dot`` of the compiled bf16 GPT training step (cannjax's model,
``GPTConfig(dtype="bfloat16")``, f32 master weights) read off its optimized HLO, with its
operands' shapes and dtypes, then re-run alone in the same form and dtypes (operands
made in the same layout as jit arguments), GFLOP/s, as a fraction of the fastest bf16
form of part 1. A dot that XLA upcast to float32 shows float32 operands here.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import interleaved_times, markdown_table, write_results  # noqa: E402

from cannjax import models  # noqa: E402
from cannjax._src.core import dots  # noqa: E402
from cannjax.core import dot_form_table  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32


@dataclasses.dataclass(frozen=True)
class Form:
    """One dot form: operand shapes and dimension numbers."""

    name: str
    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    dims: tuple  # lax.dot_general's dimension_numbers

    def flops(self) -> float:
        (ca, cb), (ba, bb) = self.dims
        out = [n for i, n in enumerate(self.lhs) if i not in ca + ba]
        out += [n for i, n in enumerate(self.rhs) if i not in cb + bb]
        size = 1
        for n in [self.lhs[i] for i in ba] + [self.lhs[i] for i in ca] + out:
            size *= n
        return 2.0 * size


def forms(n: int, k: int, p: int, b: int, t: int, h: int) -> list[Form]:
    """The step's forms: rows ``n``, width ``k``, out ``p``; ``b`` heads x batch, ``t``
    tokens, head dim ``h``."""
    return [
        Form("x @ w", (n, k), (k, p), (((1,), (0,)), ((), ()))),
        Form("x @ w^T (dx = g w^T)", (n, p), (k, p), (((1,), (1,)), ((), ()))),
        Form("weight gradient x^T g", (n, k), (n, p), (((0,), (0,)), ((), ()))),
        Form("batched q k^T", (b, t, h), (b, t, h), (((2,), (2,)), ((0,), (0,)))),
        Form("batched p v", (b, t, t), (b, t, h), (((2,), (1,)), ((0,), (0,)))),
        Form("batched p^T do", (b, t, t), (b, t, h), (((1,), (1,)), ((0,), (0,)))),
    ]


def _operands(form: Form, dtype):
    ka, kb = jax.random.split(jax.random.key(0))
    return (
        jax.random.normal(ka, form.lhs, F32).astype(dtype),
        jax.random.normal(kb, form.rhs, F32).astype(dtype),
    )


def _variants(form: Form):
    """name -> (jitted fn, operands) for one form."""
    d = form.dims
    f32 = _operands(form, F32)
    bf = _operands(form, BF16)
    cannjax_dot = dots.dot_general
    if form.name.startswith("weight gradient"):
        cannjax_dot = lambda a, b, dims: dots.weight_grad(a, b)  # noqa: E731
    return {
        "f32": (jax.jit(lambda a, b: lax.dot_general(a, b, d)), f32),
        "bf16 -> bf16": (jax.jit(lambda a, b: lax.dot_general(a, b, d)), bf),
        "bf16 x bf16 -> f32": (
            jax.jit(lambda a, b: lax.dot_general(a, b, d, preferred_element_type=F32)),
            bf,
        ),
        "cannjax bf16": (jax.jit(lambda a, b: cannjax_dot(a, b, d)), bf),
    }


def ceilings(repeats: int, sizes: dict) -> tuple[list[list[str]], dict]:
    rows, out = [], {}
    for form in forms(**sizes):
        v = _variants(form)
        calls = [(lambda f=f, a=a: f(*a)) for f, a in v.values()]
        times = interleaved_times(calls, repeats=repeats, warmup=2)
        rates = {k: form.flops() / t["median_s"] / 1e9 for k, t in zip(v, times)}
        out[form.name] = {"shape": [form.lhs, form.rhs], "gflops": rates}
        rows.append([form.name, f"{form.lhs} x {form.rhs}", *(f"{rates[k]:.0f}" for k in v)])
    return rows, out


# ------------------------------------------------------------------ the step's dots
_INSTR = re.compile(r"%([\w.\-]+) = (\w+)\[([0-9,]*)\]\{[^}]*\} (\w[\w-]*)\(([^)]*)\)(.*)")
_DIMS = {
    k: re.compile(k + r"=\{([0-9,]*)\}")
    for k in ("lhs_contracting_dims", "rhs_contracting_dims", "lhs_batch_dims", "rhs_batch_dims")
}


_HLO_DTYPES = {"f32": F32, "bf16": BF16, "f16": jnp.float16, "f64": jnp.float64}


def step_dots(hlo: str) -> collections.Counter:
    """Every ``dot`` of an optimized HLO module: (lhs dtype+shape, rhs, dims, out dtype)."""
    shapes = {}
    found = collections.Counter()
    for line in hlo.splitlines():
        m = _INSTR.search(line)
        if not m:
            continue
        name, dtype, dims, op, operands, rest = m.groups()
        shape = tuple(int(s) for s in dims.split(",") if s)
        shapes[name] = (dtype, shape)
        if op != "dot":
            continue
        ops = [o.strip().split(" ")[-1].lstrip("%") for o in operands.split(",")]
        nums = []
        for pat in _DIMS.values():
            hit = pat.search(rest)
            nums.append(tuple(int(s) for s in hit.group(1).split(",") if s) if hit else ())
        lhs, rhs = shapes[ops[0]], shapes[ops[1]]
        dims = ((nums[0], nums[1]), (nums[2], nums[3]))
        found[(lhs, rhs, dims, dtype)] += 1
    return found


def _form_name(dims) -> str:
    (ca, cb), (ba, _) = dims
    return f"contract lhs{list(ca)} rhs{list(cb)}" + (f", batch {list(ba)}" if ba else "")


def step_rows(cfg, batch: int, repeats: int, best: float):
    """Every matrix-matrix dot of the compiled bf16 GPT step, re-run alone in its form
    and dtypes, all of them interleaved (measured one after the other, the machine's
    drift showed as a 2x spread between forms that run alike)."""
    params = models.init_gpt(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (batch, cfg.seq_len), 0, cfg.vocab)
    grad = jax.jit(jax.value_and_grad(models.gpt_loss), static_argnums=3)
    hlo = grad.lower(params, tokens, tokens, cfg).compile().as_text()
    found = []
    for (lhs, rhs, dims, odt), count in sorted(step_dots(hlo).items(), key=str):
        if min(lhs[1] + rhs[1]) == 1:
            continue  # matrix-vector products (the norms' sums): not matrix-unit work
        form = Form(_form_name(dims), lhs[1], rhs[1], dims)
        a = _operands(form, _HLO_DTYPES[lhs[0]])
        acc = _HLO_DTYPES[odt]
        f = jax.jit(
            lambda x, y, d=dims, acc=acc: lax.dot_general(x, y, d, preferred_element_type=acc)
        )
        found.append((lhs, rhs, dims, odt, count, form, f, a))
    times = interleaved_times(
        [lambda f=e[6], a=e[7]: f(*a) for e in found], repeats=repeats, warmup=2
    )
    rows, out = [], []
    for (lhs, rhs, dims, odt, count, form, _, _), t in zip(found, times):
        rate = form.flops() / t["median_s"] / 1e9
        out.append(
            {"lhs": lhs, "rhs": rhs, "dims": dims, "out": odt, "count": count, "gflops": rate}
        )
        rows.append(
            [
                f"{lhs[0]}{list(lhs[1])} . {rhs[0]}{list(rhs[1])} -> {odt}",
                form.name,
                count,
                f"{rate:.0f}",
                f"{rate / best:.0%}",
            ]
        )
    return rows, out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer repeats")
    size.add_argument("--smoke", action="store_true", help="tiny shapes: checks that it runs")
    p.add_argument(
        "--tag",
        default="",
        help="appended to the results' name (dot_forms_TAG.*): a second kind of machine",
    )
    a = p.parse_args(argv)
    repeats = 2 if a.smoke else 7 if a.quick else 15
    if a.smoke:
        sizes = dict(n=64, k=32, p=64, b=2, t=16, h=8)
        cfg = models.GPTConfig(vocab=64, width=32, heads=2, layers=1, seq_len=16, dtype="bfloat16")
        batch = 2
    else:
        sizes = dict(n=2048, k=256, p=1024, b=32, t=256, h=64)
        cfg = models.GPTConfig(dtype="bfloat16")
        batch = 8
    crows, cdata = ceilings(repeats, sizes)
    best = max(r["gflops"][k] for r in cdata.values() for k in ("bf16 x bf16 -> f32",))
    f32_best = max(r["gflops"]["f32"] for r in cdata.values())
    srows, sdata = step_rows(cfg, batch, repeats, best)
    table = [f"{k[0]}/{k[1]}: {e.form} ({e.source})" for k, e in dot_form_table().items()]
    md = markdown_table(
        ["form", "shapes", "f32", "bf16 -> bf16", "bf16 x bf16 -> f32", "cannjax bf16"], crows
    )
    md += (
        f"\n\nGFLOP/s, medians of {repeats} interleaved runs. Fastest f32 form {f32_best:.0f}, "
        f"fastest bf16 form {best:.0f} GFLOP/s. Dot table: " + "; ".join(table) + ".\n\n"
    )
    md += markdown_table(
        ["dot of the bf16 GPT step", "form", "count", "GFLOP/s", "of fastest bf16"], srows
    )
    write_results(
        "dot_forms" + (f"_{a.tag}" if a.tag else ""),
        {
            "ceilings": cdata,
            "fastest_bf16_gflops": best,
            "fastest_f32_gflops": f32_best,
            "step_dots": sdata,
            "dot_table": {f"{k[0]}/{k[1]}": e.form for k, e in dot_form_table().items()},
            "repeats": repeats,
            "smoke": a.smoke,
        },
        md,
    )
    print(md)


if __name__ == "__main__":
    main()
