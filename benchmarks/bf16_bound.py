"""How fast can a bf16 GPT step get here? optimize's step against cannjax's own kernels.

Run: ``PYTHONPATH=. python benchmarks/bf16_bound.py [--quick | --smoke] [--tag TAG]``

Issue 45 asks ``cannjax.optimize`` of the bf16 flax.nnx GPT for a step 2.5x as fast as
the unoptimized one. ``optimize`` rewrites the user's model onto cannjax's operators, so
the fastest it can be is cannjax's hand-written GPT of the same shape. This suite puts
the two side by side, in one process, as medians of interleaved rounds:

- the flax.nnx GPT of ``benchmarks/_user_models.py`` with ``dtype=jnp.bfloat16``
  (float32 parameters), plain and through ``cannjax.optimize`` (the ``nnx.jit`` step of
  ``benchmarks/optimize.py``);
- the plain-JAX twin of cannjax's GPT (``models.plain_gpt_loss``, ``dtype="bfloat16"``),
  plain and optimized;
- cannjax's hand-written GPT (``models.gpt_loss``, ``dtype="bfloat16"``): the bound.

Every step is ``value_and_grad`` plus an ``optax.adam`` update at the GPT shape of
``benchmarks/gpt.py``. Two measures say where the bound comes from:

- the attention operator alone (forward and backward of ``cannjax.ops.attention``, causal,
  at the GPT's shape, times the layers): its share of the hand-written step;
- the single dot ``[2048, 256] x [256, 1024]`` in the form the plain bf16 step uses
  (bf16 operands, bf16 result) and the form cannjax uses (bf16 operands, float32
  result), and float32: the most a rewrite of the dots can gain on this machine.

The figures depend on the machine's matrix units (``docs/performance.md``); the suite
quotes its float32 and bf16 matmul ceilings. The process keeps glibc's default
allocator (``cannjax.backend.keep_freed_memory`` is not called), as ``optimize.py`` does.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _user_models as um  # noqa: E402
from _harness import interleaved_times, markdown_table, write_results  # noqa: E402
from gpt import matmul_ceilings, model_flops  # noqa: E402
from optimize import jax_step, make_cases  # noqa: E402

import cannjax  # noqa: E402
from cannjax import models, ops  # noqa: E402

TARGET = 2.5  # optimize of the bf16 flax.nnx GPT against its unoptimized step (issue 45)
SMOKE_SHAPE = um.Shape(vocab=64, width=32, heads=2, layers=2, seq_len=16, batch=2)
DOT_SHAPE = (2048, 256, 1024)  # tokens x width -> 4 * width: the MLP's first dot
DOT_CALLS = 10  # dots per timed run
STEP_HEAD = [
    "bf16 step",
    "ms",
    "spread",
    "vs plain flax.nnx",
    "vs hand-written",
    "GFLOP/s (of bf16 ceiling)",
]


def step_runs(s: um.Shape) -> dict[str, Callable[[], object]]:
    """Zero-argument callables, one training step each: the five steps of the suite."""
    case = make_cases(["nnx_bf16"], s)["nnx_bf16"]
    runs = {}
    nnx_losses = (("flax.nnx", case.loss), ("flax.nnx, optimize", cannjax.optimize(case.loss)))
    for name, loss in nnx_losses:
        step, args = case.make_step(loss), case.step_args()
        runs[name] = lambda step=step, args=args: step(*args)
    cfg = models.GPTConfig(
        vocab=s.vocab, width=s.width, heads=s.heads, layers=s.layers, seq_len=s.seq_len,
        dtype="bfloat16",
    )  # fmt: skip
    params = models.init_gpt(jax.random.key(0), cfg)
    tokens, targets = um.batch(s)

    def twin(params, tokens, targets):
        return models.plain_gpt_loss(params, tokens, targets, cfg)

    def hand(params, tokens, targets):
        return models.gpt_loss(params, tokens, targets, cfg)

    for name, loss in (
        ("plain-JAX twin", twin),
        ("plain-JAX twin, optimize", cannjax.optimize(twin)),
        ("cannjax GPT (hand-written)", hand),
    ):
        step = jax_step(loss, case.opt)
        state = (params, case.opt.init(params))

        def run(step=step, state=state):
            return step(*state, tokens, targets)

        runs[name] = run
    return runs


def attention_run(s: um.Shape):
    """One layer's attention, forward and backward, bf16, causal, at the GPT's shape."""
    shape = (s.batch, s.seq_len, s.heads, s.width // s.heads)
    rng = np.random.default_rng(0)
    q, k, v, g = (jnp.asarray(rng.normal(size=shape), jnp.bfloat16) for _ in range(4))

    @jax.jit
    def fwd_bwd(q, k, v, g):
        _, vjp = jax.vjp(lambda q, k, v: ops.attention(q, k, v, causal=True), q, k, v)
        return vjp(g)

    return lambda: fwd_bwd(q, k, v, g)


def attention_flops(s: um.Shape) -> float:
    """The attention products' flops as ``model_flops`` counts them: over the whole
    ``T x T`` logits, the forward's two products x 3, every layer."""
    return 3 * 2 * 2 * s.batch * s.seq_len**2 * s.width * s.layers


def dot_runs(m: int, k: int, n: int) -> dict[str, Callable[[], object]]:
    """The single dot ``[m, k] x [k, n]`` in three forms, each run ``DOT_CALLS`` times."""
    rng = np.random.default_rng(1)
    x32 = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    w32 = jnp.asarray(rng.normal(size=(k, n)), jnp.float32)
    x16, w16 = x32.astype(jnp.bfloat16), w32.astype(jnp.bfloat16)
    f32 = jax.jit(lambda x, w: x @ w)
    bf16_out = jax.jit(lambda x, w: x @ w)
    f32_out = jax.jit(lambda x, w: jax.lax.dot(x, w, preferred_element_type=jnp.float32))

    def calls(f, x, w):
        return lambda: [f(x, w) for _ in range(DOT_CALLS)][-1]

    return {
        "float32": calls(f32, x32, w32),
        "bf16 x bf16 -> bf16 (the plain bf16 step)": calls(bf16_out, x16, w16),
        "bf16 x bf16 -> float32 (cannjax)": calls(f32_out, x16, w16),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="5 rounds")
    size.add_argument("--smoke", action="store_true", help="tiny model, 2 rounds")
    p.add_argument(
        "--tag",
        default="",
        help="appended to the results' name (bf16_bound_TAG.*): a second kind of machine",
    )
    a = p.parse_args(argv)
    s = SMOKE_SHAPE if a.smoke else um.Shape()
    repeats = 2 if a.smoke else 5 if a.quick else 15
    dot_shape = (64, 32, 128) if a.smoke else DOT_SHAPE
    ceilings = matmul_ceilings(256, 2) if a.smoke else matmul_ceilings()

    runs = step_runs(s)
    runs["attention, fwd + bwd, one layer"] = attention_run(s)
    dots = dot_runs(*dot_shape)
    times = interleaved_times(list(runs.values()), repeats=repeats)
    # The dots apart: a few ms each, interleaved with each other (not with 0.5 s steps).
    times += interleaved_times(list(dots.values()), repeats=2 * repeats)
    med = {name: t["median_s"] / DOT_CALLS if name in dots else t["median_s"]
           for name, t in zip(list(runs) + list(dots), times)}  # fmt: skip
    spread = {name: t["iqr_rel"] for name, t in zip(list(runs) + list(dots), times)}

    cfg = models.GPTConfig(
        vocab=s.vocab, width=s.width, heads=s.heads, layers=s.layers, seq_len=s.seq_len
    )
    flops = model_flops(cfg, s.batch)
    base, hand = med["flax.nnx"], med["cannjax GPT (hand-written)"]
    steps = [n for n in runs if not n.startswith("attention")]
    step_rows = [
        [
            n,
            f"{1e3 * med[n]:.0f}",
            f"{spread[n]:.0%}",
            f"{base / med[n]:.2f}",
            f"{hand / med[n]:.2f}",
            f"{flops / med[n] / 1e9:.0f} ({flops / med[n] / 1e9 / ceilings['bfloat16']:.0%})",
        ]
        for n in steps
    ]
    att = med["attention, fwd + bwd, one layer"] * s.layers
    m, k, n = dot_shape
    dot_flops = 2 * m * k * n
    dot_rows = [[f, f"{dot_flops / med[f] / 1e9:.0f}", f"{spread[f]:.0%}"] for f in dots]
    _, plain_form, fast = (med[f] for f in dots)
    side = 256 if a.smoke else 2048
    md = (
        markdown_table(STEP_HEAD, step_rows)
        + f"\n\noptimize of the flax.nnx GPT: {base / med['flax.nnx, optimize']:.2f}x its "
        f"plain step (target {TARGET}x). optimize maps the model onto cannjax's operators, "
        f"so cannjax's hand-written GPT is the speed it can expect: {base / hand:.2f}x. For "
        f"{TARGET}x the hand-written step would have to take {1e3 * base / TARGET:.0f} ms."
        f"\n\nAttention alone (cannjax.ops.attention, causal, fwd + bwd, bf16) x {s.layers} "
        f"layers: {1e3 * att:.0f} ms, {att / hand:.0%} of the hand-written step; its "
        f"products are {attention_flops(s) / flops:.0%} of the step's counted flops.\n\n"
        + markdown_table([f"dot [{m}, {k}] x [{k}, {n}]", "GFLOP/s", "spread"], dot_rows)
        + f"\n\nOn this dot the float32-result form is {plain_form / fast:.2f}x as fast as "
        "the form the plain bf16 step uses.\n\n"
        f"GPT L={s.layers} D={s.width} N={s.heads} T={s.seq_len} V={s.vocab} B={s.batch} "
        f"({flops / 1e9:.1f} GFLOP per step, matmuls counted as in `gpt.py`); medians of "
        f"{repeats} interleaved rounds (the dots: {2 * repeats} rounds of {DOT_CALLS} calls, "
        f"interleaved with each other). Matmul ceilings ({side}^3): float32 "
        f"{ceilings['float32']:.0f}, bf16 x bf16 -> float32 {ceilings['bfloat16']:.0f} "
        "GFLOP/s. glibc's default allocator."
    )
    if a.smoke:
        md += " Smoke run (--smoke): a tiny model; the figures mean nothing."
    cmd = (
        "PYTHONPATH=. python benchmarks/bf16_bound.py"
        + (" --smoke" if a.smoke else " --quick" if a.quick else "")
        + (f" --tag {a.tag}" if a.tag else "")
    )
    write_results(
        "bf16_bound" + (f"_{a.tag}" if a.tag else ""),
        {
            "command": cmd,
            "repeats": repeats,
            "smoke": a.smoke,
            "median_s": med,
            "iqr_rel": spread,
            "flops_per_step": flops,
            "attention_all_layers_s": att,
            "dot_shape": list(dot_shape),
            "matmul_ceilings_gflops": ceilings,
            "target": TARGET,
        },
        md,
    )
    print(md)


if __name__ == "__main__":
    main()
