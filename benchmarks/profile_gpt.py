"""Where the time of one GPT training step goes on XLA:CPU, op by op.

Run: ``PYTHONPATH=. python benchmarks/profile_gpt.py [--model cannjax|plain|both] [--steps 3]
[--dtype bfloat16]``

Traces a few steps of ``benchmarks/gpt.py``'s jitted step with ``jax.profiler`` (the
CPU runtime records one event per executed HLO thunk when XLA is started with
``--xla_cpu_enable_xprof_traceme=true``, which this script sets), maps each event to
its HLO instruction (shape and JAX ``op_name``) and splits the step's wall time into:

- matmul-busy: some dot (YNNPACK fusion or plain ``dot``) is running;
- other ops only: no dot runs, some other thunk does (elementwise fusions, copies,
  transposes, dynamic-update-slices, the zero fills of ``lax.scan``'s stacked outputs);
- idle: no thunk runs (dispatch, loop control, and the Eigen-run ``dot`` thunks, which
  return before their work completes and so under-report).

The other ops' time is also summed by kind (:func:`op_kind`: converts, copies and
transposes, slice updates, reductions, other elementwise fusions), apart for the
instructions inside the operators' loops (attention's block pairs, the chunked
cross-entropy) and outside them.

The profiler adds overhead; compare splits, not absolute times, with ``gpt.py``'s.
Writes ``results/profile_gpt_<model>.json`` and ``.md`` (both models by default);
``--dtype bfloat16`` profiles the bf16-compute step (``GPTConfig(dtype="bfloat16")``, as
``gpt.py``'s bf16 rows) into ``profile_gpt_<model>_bf16.*``.
See ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true"
).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import markdown_table, write_results  # noqa: E402
from gpt import setup, step_fn, training_loop  # noqa: E402

from cannjax import models as gpt  # noqa: E402

_INSTR = re.compile(r"^\s+%(\S+) = (\S+\[[^\]]*\])\S* ([\w-]+)\(.*?\), (.*)$", re.M)


def hlo_instructions(text: str) -> dict[str, tuple[str, str]]:
    """HLO instruction name -> (shape, JAX op_name) from compiled HLO text."""
    out = {}
    for name, shape, _, rest in _INSTR.findall(text):
        op = re.search(r'op_name="([^"]*)"', rest)
        out[name] = (shape, op.group(1) if op else "")
    return out


def is_dot(name: str, op_name: str) -> bool:
    return name.startswith("dot") or (name.startswith("ynn_fusion") and "dot_general" in op_name)


# A fusion is named after opcodes it holds (``subtract_exponential_fusion``), a lone
# instruction wrapped for the runtime ``wrapped_<opcode>``; the first rule that matches
# an instruction's name decides its kind.
_KINDS = (
    (("dynamic-update-slice",), "slice updates"),
    (("dynamic-slice",), "slices"),
    (("wrapped_convert", "convert."), "lone converts"),
    (("transpose", "copy", "concatenate"), "copies, transposes, concatenations"),
    (("ynn_fusion",), "reductions (YNNPACK)"),
)


def op_kind(name: str) -> str:
    """The kind of a non-dot instruction, read off its name: a fusion of elementwise work
    (which may end in a convert) when no rule of ``_KINDS`` names it."""
    for keys, kind in _KINDS:
        if any(k in name for k in keys):
            return kind
    return "fused elementwise"


def _in_operator_loop(op_name: str) -> bool:
    """Whether an instruction runs in the loop of an operator's rule (attention's block
    pairs, the chunked cross-entropy's rows): a ``while`` under a jitted ``_`` rule."""
    return "/while" in op_name and "jit(_" in op_name


def split_time(events: list[dict], instr: dict, steps: int, top: int = 15) -> dict:
    """Wall time per step split into matmul-busy / other ops only / idle (ms), plus the
    other ops ranked by the time they run while no dot does."""
    events = [e for e in events if not re.match(r"(while|call|conditional)", e["name"])]
    t0 = min(e["ts"] for e in events)
    span = int(max(e["ts"] + e["dur"] for e in events) - t0) + 1
    dot = np.zeros(span, bool)
    others = np.zeros(span, np.int16)
    for e in events:
        a = int(e["ts"] - t0)
        b = a + int(e["dur"])
        if is_dot(e["name"], instr[e["name"]][1]):
            dot[a:b] = True
        else:
            others[a:b] += 1
    exclusive = collections.Counter()
    for e in events:
        if not is_dot(e["name"], instr[e["name"]][1]):
            a = int(e["ts"] - t0)
            b = a + int(e["dur"])
            exclusive[e["name"]] += float((~dot[a:b] / np.maximum(others[a:b], 1)).sum())
    ms = 1e-3 / steps
    kinds = collections.Counter()
    for k, v in exclusive.items():
        where = "operator loops" if _in_operator_loop(instr[k][1]) else "elsewhere"
        kinds[f"{where}: {op_kind(k)}"] += v * ms
    return {
        "span_ms": span * ms,
        "matmul_busy_ms": float(dot.sum()) * ms,
        "other_only_ms": float((~dot & (others > 0)).sum()) * ms,
        "idle_ms": float((~dot & (others == 0)).sum()) * ms,
        "other_by_kind_ms": dict(kinds.most_common()),
        "top_other": [
            {
                "instruction": k,
                "shape": instr[k][0],
                "op_name": instr[k][1][-70:],
                "ms": v * ms,
            }
            for k, v in exclusive.most_common(top)
        ],
    }


def profile(
    model: str, steps: int, repeats: int, dtype: str | None = None, top: int = 15, tag: str = ""
) -> None:
    """Traces ``steps`` steps of ``model``'s GPT step ``repeats`` times, computing in
    ``dtype`` (None: float32); writes the split of the trace with the median step time."""
    cfg, params, tokens, targets, opt, state = setup()
    cfg = dataclasses.replace(cfg, dtype=dtype)
    loss = gpt.gpt_loss if model == "cannjax" else gpt.plain_gpt_loss
    step = step_fn(loss, cfg, opt)
    instr = hlo_instructions(step.lower(params, state, tokens, targets).compile().as_text())
    run = training_loop(step, params, state, tokens, targets)  # step donates its state
    for _ in range(3):
        jax.block_until_ready(run())
    splits = []
    for _ in range(repeats):  # this machine's step time varies by up to 25% between runs
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                for _ in range(steps):
                    jax.block_until_ready(run())
            (trace,) = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)
            with gzip.open(trace) as f:
                events = json.load(f)["traceEvents"]
        events = [e for e in events if e.get("ph") == "X" and e.get("name") in instr]
        splits.append(split_time(events, instr, steps, top))
    splits.sort(key=lambda r: r["span_ms"])
    res = splits[len(splits) // 2]
    res["span_ms_of_each_trace"] = [r["span_ms"] for r in splits]
    rows = [
        [r["instruction"], f"`{r['shape']}`", r["op_name"], f"{r['ms']:.2f}"]
        for r in res["top_other"]
    ]
    suffix, flag = ("_bf16", f" --dtype {dtype}") if dtype else ("", "")
    flag += f" --tag {tag}" if tag else ""
    md = (
        f"# Profile of one GPT step, {model} model, {dtype or 'float32'}\n\n"
        f"Command: `PYTHONPATH=. python benchmarks/profile_gpt.py --model {model}{flag}`. "
        f"Per step, under the profiler (the median of {repeats} traces, "
        f"{', '.join(f'{t:.0f}' for t in res['span_ms_of_each_trace'])} ms): "
        f"{res['span_ms']:.0f} ms, of which matmul-busy "
        f"{res['matmul_busy_ms']:.0f} ms, other ops only {res['other_only_ms']:.0f} ms, "
        f"idle {res['idle_ms']:.0f} ms.\n\n"
        "Other ops, by the time they run while no dot does (ms per step):\n\n"
        + markdown_table(["instruction", "shape", "JAX op", "ms"], rows)
        + "\n\nOther ops by kind (ms per step, while no dot runs):\n\n"
        + markdown_table(
            ["where: kind", "ms"], [[k, f"{v:.1f}"] for k, v in res["other_by_kind_ms"].items()]
        )
    )
    name = f"profile_gpt_{model}{suffix}" + (f"_{tag}" if tag else "")
    write_results(name, {"steps": steps, "dtype": dtype, **res}, md)
    print(md)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("cannjax", "plain", "both"), default="both")
    p.add_argument("--steps", type=int, default=3, help="traced steps")
    p.add_argument("--repeats", type=int, default=3, help="traces; the median is kept")
    p.add_argument("--quick", action="store_true", help="one trace of 2 steps")
    p.add_argument(
        "--dtype",
        choices=("bfloat16",),
        default=None,
        help="compute dtype of the step (default float32; results gain a _bf16 suffix)",
    )
    p.add_argument("--top", type=int, default=15, help="other ops listed")
    p.add_argument(
        "--tag",
        default="",
        help="appended to the results' name (profile_gpt_<model>[_bf16]_TAG.*): a second "
        "kind of machine",
    )
    a = p.parse_args(argv)
    for model in ("cannjax", "plain") if a.model == "both" else (a.model,):
        steps, repeats = (2, 1) if a.quick else (a.steps, a.repeats)
        profile(model, steps, repeats, a.dtype, a.top, a.tag)


if __name__ == "__main__":
    main()
