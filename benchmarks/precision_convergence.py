"""Does bf16 compute train the demo's model as well as float32? Seeds against rounding.

Run: ``PYTHONPATH=. python benchmarks/precision_convergence.py [--quick | --smoke]``

The demo's GPT (``cannjax demo`` defaults: width 128, 2 layers, the sort task, batch 64,
Adam with warm-up and cosine decay) is trained for ``--steps`` steps from each of
``--seeds`` seeds, three times per seed on the same batches:

- cannjax in float32;
- cannjax with bfloat16 compute and float32 master weights (``--precision bfloat16``);
- plain JAX in float32: the same model and the same math, differentiated by JAX. Its
  gradients agree with cannjax's to float32 rounding at the start, so it shows how far
  two float32 runs drift apart from rounding alone.

Each trained model is scored by its float32 loss on one held-out batch of 1024 sequences
(``demo._held_out_loss``) and its sort accuracy. Reported: per seed, each run's
held-out loss; over seeds, the mean of each run, bf16's distance from float32 and the
float32 twin's distance from float32 (the yardstick: a precision is as good as float32
when its distance is no larger than rounding's alone), and the seeds' spread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import markdown_table, write_results  # noqa: E402

RUNS = ("cannjax float32", "cannjax bfloat16", "plain JAX float32")


def train_seed(seed: int, steps: int, smoke: bool, out: Path) -> dict[str, dict]:
    """The three runs of one seed: held-out loss, accuracy and the loss curve."""
    import jax

    from cannjax._src import demo
    from cannjax._src.fuse.transform import fuse
    from cannjax._src.models.tasks import SortTask

    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    argv = ["--steps", str(steps), "--seed", str(seed), "--quiet", "--out", str(out)]
    if smoke:
        argv += ["--width", "32", "--layers", "1", "--batch", "8", "--digits", "4"]
    args = p.parse_args(argv)
    cfg = demo._check(args)
    model = demo.MODELS[args.model]
    task = SortTask(digits=args.digits)
    params = model.init(jax.random.key(seed), cfg)
    losses = {
        RUNS[0]: (fuse(model.loss), "float32"),
        RUNS[1]: (fuse(model.loss), "bfloat16"),
        RUNS[2]: (model.plain_loss, "float32"),
    }
    key = jax.random.key(seed + 3)
    out_runs = {}
    for name, (loss_fn, precision) in losses.items():
        trained, run, _ = demo._train(name, loss_fn, params, cfg, task, args, steps, precision)
        out_runs[name] = {
            "held_out_loss": demo._held_out_loss(model.loss, trained, cfg, task, key),
            "accuracy": demo._accuracy(model.logits, trained, cfg, task, key),
            "losses": run["losses"],
        }
    return out_runs


def distance(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="3 seeds")
    size.add_argument("--smoke", action="store_true", help="a tiny model, 2 seeds, 4 steps")
    ap.add_argument("--seeds", type=int, default=None, help="seeds (default 6)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 200)")
    a = ap.parse_args(argv)
    seeds = a.seeds or (2 if a.smoke else 3 if a.quick else 6)
    steps = a.steps or (4 if a.smoke else 200)
    per_seed = {}
    with tempfile.TemporaryDirectory() as tmp:
        for s in range(seeds):
            per_seed[s] = train_seed(s, steps, a.smoke, Path(tmp))
            print(
                f"seed {s}: "
                + ", ".join(f"{k} {v['held_out_loss']:.4f}" for k, v in per_seed[s].items())
            )
    held = {r: [per_seed[s][r]["held_out_loss"] for s in per_seed] for r in RUNS}
    acc = {r: [per_seed[s][r]["accuracy"] for s in per_seed] for r in RUNS}
    f32 = RUNS[0]
    mean = {r: statistics.mean(held[r]) for r in RUNS}
    # Per seed, each run's distance from the float32 cannjax run of the same seed.
    per_seed_distance = {r: [distance(x, y) for x, y in zip(held[r], held[f32])] for r in RUNS[1:]}
    rows = [
        [
            r,
            *(f"{x:.4f}" for x in held[r]),
            f"{mean[r]:.4f}",
            "-" if r == f32 else f"{distance(mean[r], mean[f32]):.2%}",
            "-" if r == f32 else f"{statistics.median(per_seed_distance[r]):.2%}",
            f"{statistics.mean(acc[r]):.3f}",
        ]
        for r in RUNS
    ]
    md = markdown_table(
        [
            "run",
            *(f"seed {s}" for s in per_seed),
            "mean",
            "mean vs cannjax f32",
            "median per-seed distance",
            "mean sort accuracy",
        ],
        rows,
    )
    md += (
        f"\n\nHeld-out loss (float32, 1024 sequences) after {steps} steps of the demo's GPT "
        f"(`cannjax demo` defaults), {seeds} seeds. Distances are relative to the cannjax "
        "float32 run; plain JAX float32 differs from it only in rounding. Seeds' spread of "
        f"the float32 run: {min(held[f32]):.4f}-{max(held[f32]):.4f}."
    )
    if a.smoke:
        md += " Smoke run (--smoke): a tiny model, 4 steps; the figures mean nothing."
    cmd = "benchmarks/precision_convergence.py" + (
        " --smoke" if a.smoke else " --quick" if a.quick else ""
    )
    write_results(
        "precision_convergence",
        {
            "command": cmd,
            "steps": steps,
            "smoke": a.smoke,
            "held_out_loss": held,
            "accuracy": acc,
            "mean_held_out_loss": mean,
            "median_per_seed_distance": {
                r: statistics.median(d) for r, d in per_seed_distance.items()
            },
        },
        md,
    )
    print(md)


if __name__ == "__main__":
    main()
