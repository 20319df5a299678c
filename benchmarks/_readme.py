"""Assembles a README from a results folder's tables: benchmarks/README.md from results/.

Run: ``python benchmarks/_readme.py [--results DIR]`` writes ``DIR/../README.md`` from
``DIR/*.md`` (default: the committed ``benchmarks/results/``). ``cannjax bench`` runs it
last, on the folder its suites wrote to. :data:`SUITES` is also the record of each
result's command, which ``cannjax bench --write`` reruns.
"""

from __future__ import annotations

import argparse
from pathlib import Path

HERE = Path(__file__).resolve().parent

SUITES = [  # (results name, title, command)
    ("ops", "Every operator against its plain-JAX reference", "benchmarks/ops.py"),
    ("nn_ops", "Linear algebra and normalization", "benchmarks/nn_ops.py"),
    ("reductions", "Reductions, losses, safe ops", "benchmarks/reductions.py --full"),
    ("attention", "Attention and fused linear cross-entropy", "benchmarks/attention.py --quick"),
    (
        "llm_ops",
        "LLM operators: attention options, rope, gated MLPs, losses, the Llama step",
        "benchmarks/llm_ops.py",
    ),
    ("fuse", "cannjax.fuse", "benchmarks/fuse.py"),
    ("remat", "Rematerialization", "benchmarks/remat.py"),
    ("amp", "Mixed precision and loss scaling", "benchmarks/amp.py --quick"),
    ("health", "Gradient health overhead", "benchmarks/health.py"),
    ("backend_dispatch", "Per-platform kernel tables", "benchmarks/backend_dispatch.py --quick"),
    (
        "gpt",
        "End to end: GPT training step, float32 and bfloat16",
        "benchmarks/gpt.py --torch",
    ),
    (
        "llama_step",
        "End to end: Llama training step, float32 and bfloat16",
        "benchmarks/gpt.py --torch --model llama",
    ),
    (
        "gpt_amx",
        "The GPT step on a CPU with AMX (bf16 matrix tiles)",
        "benchmarks/gpt.py --torch --tag amx",
    ),
    (
        "llama_step_amx",
        "The Llama step on a CPU with AMX",
        "benchmarks/gpt.py --torch --model llama --tag amx",
    ),
    (
        "dot_forms",
        "Matrix-product forms: this machine's f32 and bf16 ceilings, the bf16 step's dots",
        "benchmarks/dot_forms.py",
    ),
    (
        "dot_forms_amx",
        "Matrix-product forms on a CPU with AMX",
        "benchmarks/dot_forms.py --tag amx",
    ),
    (
        "optimize",
        "cannjax.optimize on flax.nnx, equinox and plain-JAX training steps",
        "benchmarks/optimize.py",
    ),
    (
        "optimize_corpus",
        "cannjax.optimize on third-party transformer code (penzai, haliax, transformers, "
        "flax.nnx, equinox)",
        "benchmarks/optimize_corpus.py",
    ),
    (
        "optimize_heldout",
        "cannjax.optimize on held-out models no finder saw (dm-haiku, Keras 3, flax.linen)",
        "benchmarks/optimize_corpus.py --set heldout",
    ),
    (
        "optimize_corpus_bf16",
        "cannjax.optimize on the third-party models in mixed precision (bfloat16 compute)",
        "benchmarks/optimize_corpus.py --compute bfloat16",
    ),
    (
        "optimize_heldout_bf16",
        "cannjax.optimize on the held-out models in mixed precision (bfloat16 compute)",
        "benchmarks/optimize_corpus.py --set heldout --compute bfloat16",
    ),
    (
        "optimize_corpus_bf16_native",
        "cannjax.optimize on the third-party models under their library's own bf16 setting",
        "benchmarks/optimize_corpus.py --compute bfloat16 --recipe native",
    ),
    (
        "optimize_heldout_bf16_native",
        "cannjax.optimize on the held-out models under their library's own bf16 setting",
        "benchmarks/optimize_corpus.py --set heldout --compute bfloat16 --recipe native",
    ),
    (
        "fine_tuning",
        "Fine-tuning: fused preference losses (DPO, ORPO, SimPO, CPO, KTO) and LoRA",
        "benchmarks/fine_tuning.py",
    ),
    (
        "optimize_losses",
        "cannjax.optimize on loss spellings (optax, flax; label smoothing, z-loss, soft cap)",
        "benchmarks/optimize_losses.py",
    ),
    (
        "optimize_spellings",
        "cannjax.optimize on fuzzed norm, activation, loss and attention spellings: "
        "recognized, near-miss "
        "mutants left alone",
        "benchmarks/optimize_spellings.py",
    ),
    (
        "gpt_keep_freed",
        "The same, glibc keeping freed memory",
        "benchmarks/gpt.py --torch --keep-freed",
    ),
    (
        "precision_convergence",
        "bf16 compute against float32 and against float32's own rounding, over seeds",
        "benchmarks/precision_convergence.py",
    ),
    (
        "bf16_bound",
        "optimize's bf16 flax.nnx step against cannjax's hand-written bf16 GPT, the bound",
        "benchmarks/bf16_bound.py",
    ),
    (
        "bf16_bound_amx",
        "The same bound on a CPU with AMX",
        "benchmarks/bf16_bound.py --tag amx",
    ),
    (
        "xla_dot_libraries",
        "The bf16 step's dots under XLA:CPU's library dot fusions, process against process",
        "benchmarks/xla_dot_libraries.py",
    ),
    (
        "xla_dot_libraries_amx",
        "The same on a CPU with AMX",
        "benchmarks/xla_dot_libraries.py --tag amx",
    ),
    (
        "host_memory",
        "The GPT step with cannjax.backend.keep_freed_memory(), process against process",
        "benchmarks/host_memory.py",
    ),
    (
        "profile_gpt_cannjax",
        "Where the GPT step's time goes (cannjax)",
        "benchmarks/profile_gpt.py --model cannjax",
    ),
    (
        "profile_gpt_cannjax_bf16",
        "Where the bfloat16 GPT step's time goes (cannjax)",
        "benchmarks/profile_gpt.py --model cannjax --dtype bfloat16",
    ),
    (
        "profile_gpt_cannjax_bf16_amx",
        "The same on a CPU with AMX, with the other ops summed by kind",
        "benchmarks/profile_gpt.py --model cannjax --dtype bfloat16 --tag amx",
    ),
    (
        "profile_gpt_plain",
        "Where the GPT step's time goes (plain JAX)",
        "benchmarks/profile_gpt.py --model plain",
    ),
    (
        "recompute",
        "Norms and activations recomputed in the backward, or saved",
        "benchmarks/recompute.py",
    ),
    ("dynamic", "Variable-length training with gears", "benchmarks/dynamic.py"),
    (
        "sharding",
        "FSDP, tensor parallelism, vocabulary-parallel loss, ring attention",
        "benchmarks/sharding.py",
    ),
    ("xla_cpu_facts", "XLA:CPU facts behind the rules", "benchmarks/xla_cpu_facts.py"),
    (
        "weight_grad_forms",
        "Weight-gradient forms, alone and in the GPT step",
        "benchmarks/xla_cpu_facts.py --weight-grad-only",
    ),
    ("ops_accuracy", "Accuracy of every operator (ulps)", "benchmarks/ops_accuracy.py"),
]

INTRO = """# Benchmarks

Every figure below comes from a script in this folder, run side by side with its
baseline in one process: times are medians of interleaved runs (A B A B ...) after
warm-up, reported as ratios with their spread; memory is XLA's compiled
`memory_analysis()` (temp size) or the residuals JAX saves for the backward
(`cannjax.inspect.residuals`), which are deterministic and also asserted in the tests.
Machine: 2 shared CPU cores (XLA:CPU), so wall-clock figures carry the spread shown;
several were taken while other jobs ran (see each suite's notes). Raw results: JSON in
`results/`. Regenerate everything with `cannjax bench --write`, one suite with
`cannjax bench --write NAME` (`cannjax bench --list` names them). Without `--write`, and
with `--quick`, results go to `build/bench/` and these stay as they are. The docs quote
these results: after recording, `python benchmarks/_doc_figures.py` rewrites their tables
and lists each quoted figure that moved (`tests/test_doc_figures.py` fails until it is
updated).
"""


def assemble(results: Path = HERE / "results") -> str:
    """The README text from the tables in ``results``."""
    parts = [INTRO]
    for name, title, cmd in SUITES:
        md = results / f"{name}.md"
        if not md.exists():
            continue
        parts.append(f"## {title}\n\n`python {cmd}`\n\n{md.read_text().strip()}\n")
        png = results / f"{name}.png"
        if png.exists():
            parts.append(f"![{name}](results/{name}.png)\n")
    return "\n".join(parts)


def write(results: Path) -> Path:
    """Writes ``README.md`` beside the folder ``results``; returns its path."""
    readme = Path(results).resolve().parent / "README.md"
    readme.write_text(assemble(Path(results)))
    return readme


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--results",
        type=Path,
        default=HERE / "results",
        help="results folder to read; README.md is written beside it (benchmarks/results)",
    )
    print(f"wrote {write(p.parse_args(argv).results)}")


if __name__ == "__main__":
    main()
