"""End to end: one GPT training step, cannjax against plain JAX (and PyTorch eager).

Run: ``PYTHONPATH=. python benchmarks/gpt.py [--quick | --smoke] [--torch]``

The step is ``value_and_grad`` of the next-token loss plus an Adam update, jitted, on the
model of DESIGN.md (4 layers, width 256, 4 heads, sequence 256, batch 8, vocabulary
1024). Both JAX models share parameters (``cannjax.models.gpt``); gradients are compared
first. Times are medians of interleaved runs after warm-up (the PyTorch step, when
asked for, is interleaved with the JAX ones); memory is the compiled temp size of the
step. Throughput is reported against the measured f32 matmul ceiling. The JAX steps
donate their parameters and optimizer state, as a training loop does (and as PyTorch's
in-place update does): each run continues from the last one's state.
``--torch`` adds the same model in PyTorch eager (``pip install -e ".[torch]"``, the CPU
build of torch 2.13.0, the pin of pyproject.toml's ``torch`` extra; ``make bench``
installs it); without an importable torch the run fails. ``--keep-freed`` reruns
everything in a process whose allocator keeps freed memory (see
``docs/performance.md``). ``--smoke`` checks that the suite still runs: a tiny model, two
rounds (seconds; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import interleaved_times, markdown_table, write_results  # noqa: E402

from cannjax import models as gpt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# glibc settings (read at process start) that keep freed memory in the heap.
KEEP_FREED = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": "4294967295",
    "MALLOC_TOP_PAD_": "268435456",
}


# --smoke: the smallest model the suite runs end to end.
SMOKE = gpt.GPTConfig(vocab=64, width=32, heads=2, layers=1, seq_len=16)


def setup(batch: int = 8, cfg: gpt.GPTConfig | None = None):
    """The benchmark's model and data: ``(cfg, params, tokens, targets, opt, opt_state)``."""
    cfg = cfg or gpt.GPTConfig()
    params = gpt.init_gpt(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (batch, cfg.seq_len), 0, cfg.vocab)
    targets = jnp.roll(tokens, -1, axis=1)
    opt = optax.adam(1e-3)
    return cfg, params, tokens, targets, opt, opt.init(params)


def step_fn(loss_fn, cfg, opt):
    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets, cfg)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # Donated like a training loop's state, so that XLA may update it in place.
    return jax.jit(step, donate_argnums=(0, 1))


def training_loop(step, params, opt_state, tokens, targets):
    """A zero-argument callable that runs ``step`` once, carrying the state forward.

    It starts from copies of ``params`` and ``opt_state`` (``step`` donates them), and
    each call continues from the state the previous call returned.
    """
    state = jax.tree.map(jnp.copy, (params, opt_state))

    def run():
        nonlocal state
        *new, loss = step(*state, tokens, targets)
        state = tuple(new)
        return state, loss

    return run


def model_flops(cfg: gpt.GPTConfig, batch: int) -> float:
    """Matmul FLOPs of one training step (forward x 3), counted by hand."""
    d, t, v, r = cfg.width, cfg.seq_len, cfg.vocab, cfg.mlp_ratio
    tokens = batch * t
    per_layer = 2 * tokens * d * (3 * d + d + 2 * r * d) + 2 * 2 * batch * t * t * d
    return 3 * (cfg.layers * per_layer + 2 * tokens * d * v)


def matmul_ceiling(n: int = 2048, repeats: int = 5) -> float:
    """Measured f32 matmul GFLOP/s on this machine (n x n x n)."""
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    (t,) = interleaved_times([lambda: f(a)], repeats=repeats)
    return 2 * n**3 / t["median_s"] / 1e9


def torch_requirement() -> str:
    """The pinned torch of pyproject.toml's ``torch`` extra, e.g. ``"torch==2.13.0"``."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        (requirement,) = tomllib.load(f)["project"]["optional-dependencies"]["torch"]
    return requirement


def import_torch():
    """``torch``, or a non-zero exit that says how to install it.

    A run asked to compare with PyTorch must not write results without the comparison.
    """
    try:
        import torch
    except ImportError as e:
        raise SystemExit(
            f"benchmarks/gpt.py --torch: PyTorch cannot be imported ({e}); install the "
            f"pinned build with pip install -e '.[torch]' ({torch_requirement()}; make bench "
            "does), or run without --torch"
        ) from e
    pinned = torch_requirement().partition("==")[2]
    if torch.__version__.split("+")[0] != pinned:
        print(f"warning: torch {torch.__version__} is not the pinned {pinned}", file=sys.stderr)
    return torch


def torch_step(cfg, batch):
    """The same training step in PyTorch eager, as a zero-argument callable."""
    import numpy as np

    torch = import_torch()
    torch.manual_seed(0)
    d, n, v, t = cfg.width, cfg.heads, cfg.vocab, cfg.seq_len

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
            self.o = torch.nn.Linear(d, d, bias=False)
            self.fc1 = torch.nn.Linear(d, cfg.mlp_ratio * d)
            self.fc2 = torch.nn.Linear(cfg.mlp_ratio * d, d, bias=False)

        def forward(self, x):
            b = x.shape[0]
            q, k, vv = self.qkv(self.ln1(x)).split(d, -1)
            q, k, vv = (z.view(b, t, n, d // n).transpose(1, 2) for z in (q, k, vv))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, vv, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.pos = torch.nn.Embedding(v, d), torch.nn.Embedding(t, d)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(cfg.layers))
            self.lnf, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, v, bias=False)

        def forward(self, tok):
            x = self.emb(tok) + self.pos(torch.arange(t))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.lnf(x))

    model = GPT()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    tok = torch.from_numpy(np.random.default_rng(0).integers(0, v, (batch, t)))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(tok).view(-1, v), tok.view(-1))
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer repeats")
    size.add_argument(
        "--smoke", action="store_true", help="a tiny model, two rounds: checks that it runs"
    )
    p.add_argument(
        "--torch", action="store_true", help="add PyTorch eager (fails if torch is missing)"
    )
    p.add_argument(
        "--keep-freed",
        action="store_true",
        help="rerun in a process whose glibc keeps freed memory (no page faults on each "
        "step's fresh temp buffer; docs/performance.md); results go to gpt_keep_freed.*",
    )
    a = p.parse_args(argv)
    if a.keep_freed and os.environ.get("MALLOC_MMAP_MAX_") != "0":
        env = {**os.environ, **KEEP_FREED}
        args = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])]
        sys.exit(subprocess.call(args, env=env))
    if a.torch:
        import_torch()  # before minutes of work that could not be recorded without it
    repeats = 2 if a.smoke else 5 if a.quick else 15
    batch = 2 if a.smoke else 8
    cfg, params, tokens, targets, opt, state = setup(batch, SMOKE if a.smoke else None)

    g_c = jax.jit(jax.grad(gpt.gpt_loss), static_argnums=3)(params, tokens, targets, cfg)
    g_p = jax.jit(jax.grad(gpt.plain_gpt_loss), static_argnums=3)(params, tokens, targets, cfg)
    rel = max(
        float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
        for x, y in zip(jax.tree.leaves(g_c), jax.tree.leaves(g_p))
    )

    steps = {
        "cannjax": step_fn(gpt.gpt_loss, cfg, opt),
        "plain JAX": step_fn(gpt.plain_gpt_loss, cfg, opt),
    }
    mem = {
        k: int(
            f.lower(params, state, tokens, targets).compile().memory_analysis().temp_size_in_bytes
        )
        for k, f in steps.items()
    }
    runs = {k: training_loop(f, params, state, tokens, targets) for k, f in steps.items()}
    if a.torch:
        runs["PyTorch eager"] = torch_step(cfg, batch)
    times = interleaved_times(list(runs.values()), repeats=repeats, warmup=1 if a.smoke else 2)
    t = {k: v["median_s"] for k, v in zip(runs, times)}
    spread = {k: v["iqr_rel"] for k, v in zip(runs, times)}
    ceiling = matmul_ceiling(256, 2) if a.smoke else matmul_ceiling()
    flops = model_flops(cfg, batch)
    rows = []
    for k, s in t.items():
        rows.append(
            [
                k,
                f"{1e3 * s:.0f}",
                f"{spread[k]:.0%}",
                f"{t['plain JAX'] / s:.2f}",
                f"{t['PyTorch eager'] / s:.2f}" if "PyTorch eager" in t else "-",
                f"{mem[k] / 2**20:.0f}" if k in mem else "-",
                f"{flops / s / 1e9:.0f} ({flops / s / 1e9 / ceiling:.0%})",
            ]
        )
    md = markdown_table(
        [
            "step",
            "ms",
            "spread",
            "speed-up vs plain JAX",
            "vs PyTorch eager",
            "temp MiB",
            "GFLOP/s (of matmul ceiling)",
        ],
        rows,
    )
    md += (
        f"\n\nGPT L={cfg.layers} D={cfg.width} N={cfg.heads} T={cfg.seq_len} "
        f"V={cfg.vocab} B={batch}: {flops / 1e9:.1f} GFLOP per step; matmul ceiling "
        f"{ceiling:.0f} GFLOP/s; max relative gradient difference cannjax vs plain "
        f"{rel:.1e}."
    )
    if "PyTorch eager" in t:
        import torch

        md += f" PyTorch eager: torch {torch.__version__}, {torch.get_num_threads()} threads."
    if a.smoke:
        md += " Smoke run (--smoke): a tiny model, two rounds; the figures mean nothing."
    if a.keep_freed:
        md += " Run with glibc keeping freed memory: " + ", ".join(
            f"`{k}={v}`" for k, v in KEEP_FREED.items()
        )
    write_results(
        "gpt_keep_freed" if a.keep_freed else "gpt",
        {
            "times_s": t,
            "spread": spread,
            "temp_bytes": mem,
            "gflop_per_step": flops / 1e9,
            "matmul_ceiling_gflops": ceiling,
            "grad_max_rel_difference": rel,
            "repeats": repeats,
            "smoke": a.smoke,
        },
        md,
    )
    print(md)


if __name__ == "__main__":
    main()
