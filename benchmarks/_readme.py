"""Regenerates benchmarks/README.md from the tables in benchmarks/results/*.md.

Run: ``python benchmarks/_readme.py`` (``python -m cannjax bench`` runs it last).
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent

SUITES = [  # (results name, title, command)
    ("ops", "Every operator against its plain-JAX reference", "benchmarks/ops.py"),
    ("nn_ops", "Linear algebra and normalization", "benchmarks/nn_ops.py"),
    ("reductions", "Reductions, losses, safe ops", "benchmarks/reductions.py --full"),
    ("attention", "Attention and fused linear cross-entropy", "benchmarks/attention.py --quick"),
    ("fuse", "cannjax.fuse", "benchmarks/fuse.py"),
    ("remat", "Rematerialization", "benchmarks/remat.py"),
    ("amp", "Mixed precision and loss scaling", "benchmarks/amp.py --quick"),
    ("health", "Gradient health overhead", "benchmarks/health.py"),
    ("backend_dispatch", "Per-platform kernel tables", "benchmarks/backend_dispatch.py --quick"),
    ("gpt", "End to end: GPT training step", "benchmarks/gpt.py --torch"),
    (
        "gpt_keep_freed",
        "The same, glibc keeping freed memory",
        "benchmarks/gpt.py --torch --keep-freed",
    ),
    (
        "profile_gpt_cannjax",
        "Where the GPT step's time goes (cannjax)",
        "benchmarks/profile_gpt.py --model cannjax",
    ),
    (
        "profile_gpt_plain",
        "Where the GPT step's time goes (plain JAX)",
        "benchmarks/profile_gpt.py --model plain",
    ),
    ("xla_cpu_facts", "XLA:CPU facts behind the rules", "benchmarks/xla_cpu_facts.py"),
]

INTRO = """# Benchmarks

Every figure below comes from a script in this folder, run side by side with its
baseline in one process: times are medians of interleaved runs (A B A B ...) after
warm-up, reported as ratios with their spread; memory is XLA's compiled
`memory_analysis()` (temp size) or the residuals JAX saves for the backward
(`cannjax.inspect.residuals`), which are deterministic and also asserted in the tests.
Machine: 2 shared CPU cores (XLA:CPU), so wall-clock figures carry the spread shown;
several were taken while other jobs ran (see each suite's notes). Raw results: JSON in
`results/`. Regenerate everything with `python -m cannjax bench` (or one suite with the
command shown, prefixed by `PYTHONPATH=.`).
"""


def assemble() -> str:
    """The README text from the current results."""
    parts = [INTRO]
    for name, title, cmd in SUITES:
        md = HERE / "results" / f"{name}.md"
        if not md.exists():
            continue
        parts.append(f"## {title}\n\n`python {cmd}`\n\n{md.read_text().strip()}\n")
        png = HERE / "results" / f"{name}.png"
        if png.exists():
            parts.append(f"![{name}](results/{name}.png)\n")
    return "\n".join(parts)


def main() -> None:
    (HERE / "README.md").write_text(assemble())


if __name__ == "__main__":
    main()
