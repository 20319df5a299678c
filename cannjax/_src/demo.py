"""The main job: train a small GPT on a synthetic task with cannjax, then the same model
in plain JAX, and compare them side by side.

``python -m cannjax demo [--steps N] [--precision P] [--remat R] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cannjax import amp
from cannjax._src.fuse.transform import fuse
from cannjax._src.inspect import residuals
from cannjax._src.models import gpt
from cannjax._src.models.tasks import SortTask


class DemoError(Exception):
    """A user-facing problem with the demo's options (reported without a traceback)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Declares the demo's command-line options on ``p``."""
    p.add_argument("--steps", type=int, default=1000, help="cannjax training steps (1000)")
    p.add_argument(
        "--plain-steps",
        type=int,
        default=20,
        help="plain-JAX steps for the side-by-side comparison (20)",
    )
    p.add_argument("--batch", type=int, default=64, help="sequences per step (64)")
    p.add_argument("--width", type=int, default=128, help="model width D (128)")
    p.add_argument("--heads", type=int, default=4, help="attention heads; must divide width (4)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (2)")
    p.add_argument("--digits", type=int, default=16, help="sort task: digits per sequence (16)")
    p.add_argument(
        "--lr",
        type=float,
        default=3e-3,
        help="peak Adam learning rate (3e-3; warm-up, then cosine decay to 1/10)",
    )
    p.add_argument(
        "--remat",
        choices=("none", "layer"),
        default="layer",
        help="recompute each block in the backward (layer) or not (none)",
    )
    p.add_argument(
        "--precision",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="compute dtype of the cannjax run (params stay float32); float16 trains with "
        "dynamic loss scaling",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (0)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("cannjax-demo"),
        help="output folder for report.json and plots (cannjax-demo/)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _check(args: argparse.Namespace) -> gpt.GPTConfig:
    for name in ("steps", "plain_steps", "batch", "width", "heads", "layers", "digits"):
        if getattr(args, name) < 1:
            raise DemoError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.width % args.heads:
        raise DemoError(f"--heads={args.heads} must divide --width={args.width}")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        probe = args.out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise DemoError(f"--out {args.out}: cannot write there ({e.strerror or e})") from None
    task = SortTask(digits=args.digits)
    return gpt.GPTConfig(
        vocab=task.vocab,
        width=args.width,
        heads=args.heads,
        layers=args.layers,
        seq_len=task.seq_len,
        remat=args.remat,
    )


def _progress(i: int, n: int, loss: float, tok_s: float, quiet: bool) -> None:
    if quiet:
        return
    w = 30
    done = int(w * i / n)
    sys.stderr.write(
        f"\r[{'#' * done}{'.' * (w - done)}] {i}/{n} loss {loss:.4f} {tok_s:,.0f} tok/s"
    )
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _make_step(loss_fn: Callable[..., jax.Array], cfg, opt) -> Callable[..., Any]:
    def step(params, opt_state, loss_scale, batch):
        def loss(p):
            return loss_fn(p, batch.tokens, batch.targets, cfg, batch.weights)

        value, grads, loss_scale, finite = amp.value_and_grad(loss, loss_scale)(params)
        updates, opt_state = opt.update(grads, opt_state, params, grads_finite=finite)
        return optax.apply_updates(params, updates), opt_state, loss_scale, value

    return jax.jit(step)


def _with_precision(loss_fn, precision: str):
    """``loss_fn`` computing in ``precision`` (params stay float32, the loss is float32)."""
    if precision == "float32":
        return loss_fn
    policy = amp.get_policy(f"params=float32,compute={precision},output=float32")
    return amp.with_policy(loss_fn, policy=policy)


def _train(name, loss_fn, params, cfg, task, args, steps, precision="float32"):
    # Warm-up then cosine decay, and global-norm clipping: without them Adam at 3e-3
    # spiked the loss now and then (the schedule spans --steps for both runs, so the
    # plain-JAX run follows the cannjax run's first steps exactly).
    lr = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=max(1, args.steps // 20), decay_steps=args.steps,
        end_value=args.lr / 10,
    )  # fmt: skip
    opt = amp.skip_nonfinite(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr)))
    step = _make_step(_with_precision(loss_fn, precision), cfg, opt)
    loss_scale = amp.DynamicLossScale() if precision == "float16" else amp.NoOpLossScale()
    opt_state = opt.init(params)
    key = jax.random.key(args.seed + 1)
    batch = task.batch(key, args.batch)
    t0 = time.perf_counter()
    step.lower(params, opt_state, loss_scale, batch).compile()
    compile_s = time.perf_counter() - t0
    losses, times = [], []
    tokens_per_step = args.batch * cfg.seq_len
    for i in range(steps):
        batch = task.batch(jax.random.fold_in(key, i), args.batch)
        t = time.perf_counter()
        params, opt_state, loss_scale, loss = step(params, opt_state, loss_scale, batch)
        loss = float(loss)
        times.append(time.perf_counter() - t)
        losses.append(loss)
        if i % 10 == 0 or i == steps - 1:
            _progress(i + 1, steps, loss, tokens_per_step / statistics.median(times), args.quiet)
    return params, {"name": name, "losses": losses, "step_s": times, "compile_s": compile_s}


def _memory(loss_fn, params, cfg, batch):
    grad = jax.grad(loss_fn)
    compiled = (
        jax.jit(grad, static_argnums=3)
        .lower(params, batch.tokens, batch.targets, cfg, batch.weights)
        .compile()
    )
    res = residuals(lambda p: loss_fn(p, batch.tokens, batch.targets, cfg, batch.weights), params)
    return int(compiled.memory_analysis().temp_size_in_bytes), res.total_bytes


def _accuracy(logits_fn, params, cfg, task, key, n=256):
    batch = task.batch(key, n)
    return float(
        task.accuracy(jax.jit(logits_fn, static_argnums=2)(params, batch.tokens, cfg), batch)
    )


def _plots(out: Path, runs: dict, mem: dict) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for name, r in runs.items():
        ax.plot(np.arange(1, len(r["losses"]) + 1), r["losses"], label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=80)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = list(mem)
    x = np.arange(len(names))
    ax.bar(x - 0.2, [mem[n]["temp_bytes"] / 2**20 for n in names], 0.4, label="compiled temp")
    ax.bar(x + 0.2, [mem[n]["residual_bytes"] / 2**20 for n in names], 0.4, label="residuals")
    ax.set_xticks(x, names)
    ax.set_ylabel("MiB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=80)
    plt.close("all")
    return ["loss.png", "memory.png"]


def run(args: argparse.Namespace) -> int:
    """Runs the demo; returns the exit code."""
    cfg = _check(args)
    task = SortTask(digits=args.digits)
    params = gpt.init_gpt(jax.random.key(args.seed), cfg)
    print(
        f"cannjax demo: GPT (L={cfg.layers}, D={cfg.width}, N={cfg.heads}, T={cfg.seq_len},"
        f" V={cfg.vocab}) on the sort task, batch {args.batch}, {jax.default_backend()}"
    )
    # Same initial gradients (to float32 rounding) before any training.
    b0 = task.batch(jax.random.key(args.seed + 2), args.batch)
    g_c = jax.jit(jax.grad(gpt.gpt_loss), static_argnums=3)(
        params, b0.tokens, b0.targets, cfg, b0.weights
    )
    g_p = jax.jit(jax.grad(gpt.plain_gpt_loss), static_argnums=3)(
        params, b0.tokens, b0.targets, cfg, b0.weights
    )
    num = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree_util.tree_leaves(g_c), jax.tree_util.tree_leaves(g_p))
    )
    den = max(float(jnp.max(jnp.abs(b))) for b in jax.tree_util.tree_leaves(g_p))
    print(f"gradient agreement with plain JAX at init: max rel. difference {num / den:.2e}")

    # The cannjax run: cannjax operators, elementwise work fused, each block recomputed in
    # the backward (--remat layer), compute in --precision with loss scaling for float16.
    cannjax_loss = fuse(gpt.gpt_loss)
    print(f"training with cannjax ({args.precision}, remat={args.remat}) for {args.steps} steps")
    trained, run_c = _train(
        "cannjax", cannjax_loss, params, cfg, task, args, args.steps, args.precision
    )
    print(f"training plain JAX for {args.plain_steps} steps")
    _, run_p = _train("plain JAX", gpt.plain_gpt_loss, params, cfg, task, args, args.plain_steps)
    mem = {}
    for name, fn in (("cannjax", cannjax_loss), ("plain JAX", gpt.plain_gpt_loss)):
        t, r = _memory(fn, params, cfg, b0)
        mem[name] = {"temp_bytes": t, "residual_bytes": r}
    acc = _accuracy(gpt.gpt_logits, trained, cfg, task, jax.random.key(args.seed + 3))
    n = min(args.steps, args.plain_steps)
    rows = []
    for name, r in (("cannjax", run_c), ("plain JAX", run_p)):
        rows.append(
            [
                name,
                f"{1e3 * statistics.median(r['step_s'][1:] or r['step_s']):.1f}",
                f"{mem[name]['temp_bytes'] / 2**20:.1f}",
                f"{mem[name]['residual_bytes'] / 2**20:.1f}",
                f"{r['losses'][n - 1]:.4f}",
            ]
        )
    ratio = statistics.median(run_p["step_s"][1:] or run_p["step_s"]) / statistics.median(
        run_c["step_s"][1:] or run_c["step_s"]
    )
    head = ["model", "step ms", "temp MiB", "residual MiB", f"loss@{n}"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    print(
        f"\nplain JAX step time / cannjax step time = {ratio:.2f}; "
        f"final loss {run_c['losses'][-1]:.4f}, "
        f"sort accuracy {acc:.3f} after {args.steps} steps"
    )
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": cfg.__dict__,
        "backend": jax.default_backend(),
        "grad_max_rel_difference": num / den,
        "speedup": ratio,
        "accuracy": acc,
        "memory": mem,
        "runs": {
            k: {
                "losses": v["losses"],
                "step_ms_median": 1e3 * statistics.median(v["step_s"][1:] or v["step_s"]),
                "compile_s": v["compile_s"],
            }
            for k, v in (("cannjax", run_c), ("plain JAX", run_p))
        },
    }
    report["plots"] = _plots(args.out, {"cannjax": run_c, "plain JAX": run_p}, mem)
    (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"wrote {args.out / 'report.json'}" + "".join(f", {args.out / p}" for p in report["plots"])
    )
    return 0
