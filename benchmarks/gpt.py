"""End to end: one GPT (or Llama) training step, cannjax against plain JAX and PyTorch.

Run: ``PYTHONPATH=. python benchmarks/gpt.py [--quick | --smoke] [--torch] [--model llama]
[--tag TAG]``

The step is ``value_and_grad`` of the next-token loss plus an Adam update, jitted, on the
model of DESIGN.md (4 layers, width 256, 4 heads, sequence 256, batch 8, vocabulary
1024), or with ``--model llama`` on the Llama of ``benchmarks/llm_ops.py`` (4 layers, width
256, 8 heads, 2 kv heads, SwiGLU 704, sequence 512, batch 4). Each runs in two precisions:
float32, and bfloat16 compute with float32 master weights (``GPTConfig(dtype=
"bfloat16")``: the parameters cast inside the loss, the loss and gradients in float32;
PyTorch: ``torch.autocast("cpu", torch.bfloat16)``, its documented mixed-precision path).
The models' default ``unroll=None`` unrolls the layer loop in half precision on XLA:CPU
(both twins); one more row runs the cannjax bf16 step with the loop rolled.
The JAX models share parameters (``cannjax.models``); gradients are compared first. Times
are medians of interleaved runs after warm-up (every row of a model interleaved with every
other); memory is the compiled temp size of the step. Throughput is reported against the
machine's measured matmul ceiling of the row's precision (f32, and bf16 x bf16 -> f32:
``benchmarks/dot_forms.py`` has every form). The JAX steps donate their parameters and
optimizer state, as a training loop does (and as PyTorch's in-place update does): each run
continues from the last one's state.
``--torch`` adds the same model in PyTorch eager (``pip install -e ".[torch]"``, the CPU
build of torch 2.13.0, the pin of pyproject.toml's ``torch`` extra; ``make bench``
installs it); without an importable torch the run fails. ``--keep-freed`` first
calls :func:`cannjax.backend.keep_freed_memory` (before JAX's backend starts), so that
the process's allocator keeps freed memory (see ``docs/performance.md``). ``--smoke``
checks that the suite still runs: a tiny model, two rounds (seconds; its figures mean
nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import interleaved_times, markdown_table, write_results  # noqa: E402

from cannjax import models as gpt  # noqa: E402
from cannjax.backend import keep_freed_memory  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# --smoke: the smallest models the suite runs end to end.
SMOKE = gpt.GPTConfig(vocab=64, width=32, heads=2, layers=1, seq_len=16)
SMOKE_LLAMA = gpt.LlamaConfig(
    vocab=64, width=32, heads=4, kv_heads=2, layers=1, seq_len=16, hidden=64
)
# The Llama of benchmarks/llm_ops.py's step row (vocabulary as the GPT's).
LLAMA = gpt.LlamaConfig(
    vocab=1024, width=256, heads=8, kv_heads=2, layers=4, seq_len=512, hidden=704
)
LLAMA_BATCH = 4

# Row names: the float32 rows keep the names earlier results used.
PRECISIONS = {"float32": "", "bfloat16": " bf16"}
TORCH_ROWS = {"float32": "PyTorch eager", "bfloat16": "PyTorch autocast bf16"}
# The bf16 cannjax step with its layer loop rolled (``unroll=1``): what the default,
# unrolled on XLA:CPU in half precision (docs/amp.md), saves.
ROLLED_ROW = "cannjax bf16, layer scan rolled"


@dataclasses.dataclass(frozen=True)
class Model:
    """One model of the suite: its config, init, the two losses and its matmul FLOPs."""

    name: str
    cfg: Any
    batch: int
    init: Callable
    loss: Callable  # cannjax
    plain_loss: Callable
    flops: Callable[[Any, int], float]


def gpt_flops(cfg: gpt.GPTConfig, batch: int) -> float:
    """Matmul FLOPs of one GPT training step (forward x 3), counted by hand."""
    d, t, v, r = cfg.width, cfg.seq_len, cfg.vocab, cfg.mlp_ratio
    tokens = batch * t
    per_layer = 2 * tokens * d * (3 * d + d + 2 * r * d) + 2 * 2 * batch * t * t * d
    return 3 * (cfg.layers * per_layer + 2 * tokens * d * v)


def llama_flops(cfg: gpt.LlamaConfig, batch: int) -> float:
    """Matmul FLOPs of one Llama training step (forward x 3), counted by hand."""
    d, t, h = cfg.width, cfg.seq_len, cfg.head_dim
    tokens = batch * t
    proj = 2 * tokens * d * (2 * d + 2 * cfg.kv_heads * h)  # q, o; k, v
    mlp = 2 * tokens * 3 * d * cfg.hidden
    attn = 2 * 2 * batch * t * t * d
    return 3 * (cfg.layers * (proj + mlp + attn) + 2 * tokens * d * cfg.vocab)


model_flops = gpt_flops  # the name earlier callers use


def model(name: str, smoke: bool) -> Model:
    if name == "gpt":
        cfg, batch = (SMOKE, 2) if smoke else (gpt.GPTConfig(), 8)
        return Model("GPT", cfg, batch, gpt.init_gpt, gpt.gpt_loss, gpt.plain_gpt_loss, gpt_flops)
    cfg, batch = (SMOKE_LLAMA, 2) if smoke else (LLAMA, LLAMA_BATCH)
    return Model(
        "Llama",
        cfg,
        batch,
        gpt.init_llama,
        gpt.llama_loss,
        gpt.plain_llama_loss,
        llama_flops,
    )


def setup(batch: int = 8, cfg: Any = None, init: Callable = gpt.init_gpt):
    """The benchmark's model and data: ``(cfg, params, tokens, targets, opt, opt_state)``."""
    cfg = cfg or gpt.GPTConfig()
    params = init(jax.random.key(0), cfg)
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


def matmul_ceilings(n: int = 2048, repeats: int = 5) -> dict[str, float]:
    """Measured matmul GFLOP/s on this machine (n x n x n), per precision, interleaved:
    float32, and bfloat16 operands accumulated in float32 (the form bf16 steps use)."""
    a32 = jnp.ones((n, n), jnp.float32)
    a16 = a32.astype(jnp.bfloat16)
    f32 = jax.jit(lambda a: a @ a)
    f16 = jax.jit(lambda a: jax.lax.dot(a, a, preferred_element_type=jnp.float32))
    t32, t16 = interleaved_times([lambda: f32(a32), lambda: f16(a16)], repeats=repeats)
    return {p: 2 * n**3 / t["median_s"] / 1e9 for p, t in zip(PRECISIONS, (t32, t16))}


def matmul_ceiling(n: int = 2048, repeats: int = 5) -> float:
    """Measured f32 matmul GFLOP/s on this machine (n x n x n)."""
    return matmul_ceilings(n, repeats)["float32"]


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


def _torch_gpt(torch, cfg):
    d, n, v, t = cfg.width, cfg.heads, cfg.vocab, cfg.seq_len
    F = torch.nn.functional

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
            a = F.scaled_dot_product_attention(q, k, vv, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

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

    return GPT()


def _torch_llama(torch, cfg):
    """Hugging Face Llama's layout: RMS norms, rotate-half rope, GQA, SwiGLU, tied head."""
    d, n, kv, h, t = cfg.width, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.seq_len
    F = torch.nn.functional
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, h, 2, dtype=torch.float32) / h)
    angles = torch.arange(t, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], -1)  # [T, H]
    cos, sin = angles.cos()[None, None], angles.sin()[None, None]  # [1, 1, T, H]

    def rope(x):  # [B, N, T, H]
        x1, x2 = x.chunk(2, -1)
        return x * cos.to(x.dtype) + torch.cat([-x2, x1], -1) * sin.to(x.dtype)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n1 = torch.nn.RMSNorm(d, eps=cfg.norm_eps)
            self.n2 = torch.nn.RMSNorm(d, eps=cfg.norm_eps)
            self.qkv = torch.nn.Linear(d, (n + 2 * kv) * h, bias=False)
            self.o = torch.nn.Linear(n * h, d, bias=False)
            self.gate = torch.nn.Linear(d, cfg.hidden, bias=False)
            self.up = torch.nn.Linear(d, cfg.hidden, bias=False)
            self.down = torch.nn.Linear(cfg.hidden, d, bias=False)

        def forward(self, x):
            b = x.shape[0]
            q, k, v = self.qkv(self.n1(x)).split([n * h, kv * h, kv * h], -1)
            q = rope(q.view(b, t, n, h).transpose(1, 2))
            k = rope(k.view(b, t, kv, h).transpose(1, 2))
            v = v.view(b, t, kv, h).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, n * h))
            y = self.n2(x)
            return x + self.down(F.silu(self.gate(y)) * self.up(y))

    class Llama(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(cfg.vocab, d)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(cfg.layers))
            self.norm = torch.nn.RMSNorm(d, eps=cfg.norm_eps)

        def forward(self, tok):
            x = self.emb(tok)
            for blk in self.blocks:
                x = blk(x)
            return self.norm(x) @ self.emb.weight.T  # tied, as cannjax's default

    return Llama()


def torch_step(cfg, batch, precision: str = "float32"):
    """The same training step in PyTorch eager, as a zero-argument callable.

    ``precision="bfloat16"`` runs the forward and the loss under
    ``torch.autocast("cpu", dtype=torch.bfloat16)`` (float32 weights and optimizer).
    """
    import contextlib

    import numpy as np

    torch = import_torch()
    torch.manual_seed(0)
    build = _torch_llama if isinstance(cfg, gpt.LlamaConfig) else _torch_gpt
    net = build(torch, cfg)
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    v = cfg.vocab
    tok = torch.from_numpy(np.random.default_rng(0).integers(0, v, (batch, cfg.seq_len)))

    def precision_scope():
        if precision == "float32":
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=getattr(torch, precision))

    def step():
        opt.zero_grad(set_to_none=True)
        with precision_scope():
            loss = torch.nn.functional.cross_entropy(net(tok).view(-1, v), tok.view(-1))
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def grad_difference(m: Model, params, tokens, targets, cfg) -> float:
    """Largest relative difference, leaf by leaf, of cannjax's gradient against plain's."""
    grads = [
        jax.jit(jax.grad(f), static_argnums=3)(params, tokens, targets, cfg)
        for f in (m.loss, m.plain_loss)
    ]
    return max(
        float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
        for x, y in zip(*(jax.tree.leaves(g) for g in grads))
    )


def run_model(m: Model, repeats: int, warmup: int, with_torch: bool) -> dict[str, Any]:
    """Every row of one model (JAX and, when asked, PyTorch, each in both precisions),
    interleaved: times, spreads, compiled temp sizes and gradient differences."""
    cfg, params, tokens, targets, opt, state = setup(m.batch, m.cfg, m.init)
    rel, steps, mem = {}, {}, {}
    for precision, suffix in PRECISIONS.items():
        c = dataclasses.replace(cfg, dtype=None if precision == "float32" else precision)
        rel[precision] = grad_difference(m, params, tokens, targets, c)
        steps["cannjax" + suffix] = (step_fn(m.loss, c, opt), precision)
        steps["plain JAX" + suffix] = (step_fn(m.plain_loss, c, opt), precision)
    rolled = dataclasses.replace(cfg, dtype="bfloat16", unroll=1)
    steps[ROLLED_ROW] = (step_fn(m.loss, rolled, opt), "bfloat16")
    for k, (f, _) in steps.items():
        compiled = f.lower(params, state, tokens, targets).compile()
        mem[k] = int(compiled.memory_analysis().temp_size_in_bytes)
    runs = {k: training_loop(f, params, state, tokens, targets) for k, (f, _) in steps.items()}
    precision = {k: p for k, (_, p) in steps.items()}
    if with_torch:
        for p, name in TORCH_ROWS.items():
            runs[name] = torch_step(cfg, m.batch, p)
            precision[name] = p
    times = interleaved_times(list(runs.values()), repeats=repeats, warmup=warmup)
    return {
        "config": repr(cfg),
        "batch": m.batch,
        "gflop_per_step": m.flops(cfg, m.batch) / 1e9,
        "times_s": {k: t["median_s"] for k, t in zip(runs, times)},
        "spread": {k: t["iqr_rel"] for k, t in zip(runs, times)},
        "precision": precision,
        "temp_bytes": mem,
        "grad_max_rel_difference": rel["float32"],
        "grad_max_rel_difference_bf16": rel["bfloat16"],
    }


def table(m: Model, res: dict[str, Any], ceilings: dict[str, float]) -> str:
    """The model's rows: time, ratios (to plain JAX f32, to PyTorch in the same
    precision), temp, and GFLOP/s as a share of the row precision's ceiling."""
    t, gflop = res["times_s"], res["gflop_per_step"]
    base = t["plain JAX"]
    with_torch = any(r in t for r in TORCH_ROWS.values())
    rows = []
    for k, s in t.items():
        p = res["precision"][k]
        torch_t = t.get(TORCH_ROWS[p])
        rate = gflop / s
        rows.append(
            [
                k,
                p,
                f"{1e3 * s:.0f}",
                f"{res['spread'][k]:.0%}",
                f"{base / s:.2f}",
                *([f"{torch_t / s:.2f}" if torch_t else "-"] if with_torch else []),
                f"{res['temp_bytes'][k] / 2**20:.0f}" if k in res["temp_bytes"] else "-",
                f"{rate:.0f} ({rate / ceilings[p]:.0%})",
            ]
        )
    cfg = res["config"]
    return markdown_table(
        [
            "step",
            "precision",
            "ms",
            "spread",
            "vs plain JAX f32",
            *(["vs PyTorch (same precision)"] if with_torch else []),
            "temp MiB",
            "GFLOP/s (of the precision's matmul ceiling)",
        ],
        rows,
    ) + (
        f"\n\n{m.name} {cfg}, B={m.batch}: {gflop:.1f} GFLOP per step; max relative gradient "
        f"difference cannjax vs plain {res['grad_max_rel_difference']:.1e} (float32), "
        f"{res['grad_max_rel_difference_bf16']:.1e} (bfloat16)."
    )


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
        "--model",
        choices=("gpt", "llama"),
        default="gpt",
        help="the GPT of DESIGN.md (default; results gpt.*) or the Llama of llm_ops.py "
        "(results llama_step.*)",
    )
    p.add_argument(
        "--keep-freed",
        action="store_true",
        help="make glibc keep freed memory (cannjax.backend.keep_freed_memory: no page "
        "faults on each step's fresh temp buffer; docs/performance.md); results go to "
        "gpt_keep_freed.* (llama_step_keep_freed.* with --model llama)",
    )
    p.add_argument(
        "--tag",
        default="",
        help="appended to the results' name (gpt_TAG.*): a run on a second kind of machine "
        "beside the recorded one, e.g. --tag amx on a CPU with AMX",
    )
    a = p.parse_args(argv)
    if a.keep_freed and not keep_freed_memory():
        raise SystemExit(
            "benchmarks/gpt.py --keep-freed: this C library is not glibc, so "
            "cannjax.backend.keep_freed_memory changes nothing here"
        )
    if a.torch:
        import_torch()  # before minutes of work that could not be recorded without it
    repeats = 2 if a.smoke else 5 if a.quick else 15
    m = model(a.model, a.smoke)
    res = run_model(m, repeats, 1 if a.smoke else 2, a.torch)
    ceilings = matmul_ceilings(256, 2) if a.smoke else matmul_ceilings()
    md = table(m, res, ceilings)
    md += (
        f" Matmul ceilings (2048^3, this machine): float32 {ceilings['float32']:.0f}, "
        f"bfloat16 x bfloat16 -> float32 {ceilings['bfloat16']:.0f} GFLOP/s."
    )
    if a.torch:
        import torch

        md += f" PyTorch: torch {torch.__version__}, {torch.get_num_threads()} threads."
    if a.smoke:
        md += " Smoke run (--smoke): a tiny model, two rounds; the figures mean nothing."
    if a.keep_freed:
        md += " Run with glibc keeping freed memory (`cannjax.backend.keep_freed_memory()`)."
    name = "llama_step" if a.model == "llama" else "gpt"
    write_results(
        name + ("_keep_freed" if a.keep_freed else "") + (f"_{a.tag}" if a.tag else ""),
        {
            **res,
            "matmul_ceiling_gflops": ceilings["float32"],
            "matmul_ceilings_gflops": ceilings,
            "repeats": repeats,
            "smoke": a.smoke,
        },
        md,
    )
    print(md)


if __name__ == "__main__":
    main()
