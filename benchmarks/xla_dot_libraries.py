"""Do XLA:CPU's library dot fusions run the bf16 step's dots faster? Process against process.

Run: ``PYTHONPATH=. python benchmarks/xla_dot_libraries.py [--quick | --smoke] [--tag TAG]``

XLA:CPU can hand dots to a kernel library, chosen by a flag at start-up
(``--xla_cpu_experimental_{ynn,xnn,onednn}_fusion_type=LIBRARY_FUSION_TYPE_DOT``). A flag
cannot change within a process, so each round runs one child process per setting (no
flag, and each library), the order rotating between rounds. Each child times, as
medians of interleaved runs, the dots of cannjax's bf16 GPT step (bf16 operands, float32
result): a projection ``[2048, 256] x [256, 1024]``, its weight gradient (contracting
the 2048 tokens, the tokens-by-width operand transposed once, as cannjax forms it) and
attention's two block products, batched over ``[8, 4]`` (batch,
heads) with blocks of 128 rows and 64 features, as ``cannjax.ops.attention`` forms them.
The table gives each setting's median GFLOP/s over the rounds. See ``docs/optimize.md``
("The bfloat16 step's bound").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import markdown_table, round_order, write_results  # noqa: E402

FLAG = "--xla_cpu_experimental_{}_fusion_type=LIBRARY_FUSION_TYPE_DOT"
SETTINGS = {
    "no flag": "",
    "YNNPACK": FLAG.format("ynn"),
    "XNNPACK": FLAG.format("xnn"),
    "oneDNN": FLAG.format("onednn"),
}
# name -> (lhs shape, rhs shape, dimension numbers); bf16 x bf16 -> float32.
DOTS = {
    "projection x w": ((2048, 256), (256, 1024), (((1,), (0,)), ((), ()))),
    # x^T g with x transposed once, as cannjax's bf16 backward forms it (core/dots.py).
    "weight gradient x^T g": ((256, 2048), (2048, 1024), (((1,), (0,)), ((), ()))),
    "attention q k^T": ((8, 4, 128, 64), (8, 4, 128, 64), (((3,), (3,)), ((0, 1), (0, 1)))),
    "attention p v": ((8, 4, 128, 128), (8, 4, 128, 64), (((3,), (2,)), ((0, 1), (0, 1)))),
}


def _flops(lhs, rhs, dims) -> float:
    """``2 * |lhs| * (rhs's free extent)``: every lhs element meets each free rhs column."""
    (_, rc), (_, rb) = dims
    free = [d for i, d in enumerate(rhs) if i not in rc + rb]
    return 2.0 * math.prod(lhs) * math.prod(free)


def child(repeats: int, scale: int) -> dict[str, float]:
    """GFLOP/s of each dot in this process (XLA_FLAGS as the parent set them)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from _harness import interleaved_times

    rng = np.random.default_rng(0)
    runs, flops = [], []
    for lhs, rhs, dims in DOTS.values():
        lhs = tuple(max(1, d // scale) for d in lhs)
        rhs = tuple(max(1, d // scale) for d in rhs)
        a = jnp.asarray(rng.normal(size=lhs), jnp.bfloat16)
        b = jnp.asarray(rng.normal(size=rhs), jnp.bfloat16)
        f = jax.jit(
            lambda a, b, dims=dims: jax.lax.dot_general(
                a, b, dims, preferred_element_type=jnp.float32
            )
        )
        runs.append(lambda f=f, a=a, b=b: f(a, b))
        flops.append(_flops(lhs, rhs, dims))
    times = interleaved_times(runs, repeats=repeats, warmup=3)
    return {n: fl / t["median_s"] / 1e9 for n, fl, t in zip(DOTS, flops, times)}


def spawn(setting: str, repeats: int, scale: int) -> dict[str, float]:
    flags = f"{os.environ.get('XLA_FLAGS', '')} {SETTINGS[setting]}".strip()
    env = {**os.environ, "XLA_FLAGS": flags}
    args = [sys.executable, __file__, "--child", "--repeats", str(repeats), "--scale", str(scale)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    if out.returncode:
        raise RuntimeError(f"the {setting} child failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="2 rounds")
    size.add_argument("--smoke", action="store_true", help="small dots, 1 round")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=None, help="timed runs per child (20)")
    p.add_argument("--scale", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument(
        "--tag",
        default="",
        help="appended to the results' name (xla_dot_libraries_TAG.*): a second kind of machine",
    )
    a = p.parse_args(argv)
    repeats = a.repeats or (2 if a.smoke else 20)
    if a.child:
        print(json.dumps(child(repeats, a.scale)))
        return
    rounds = 1 if a.smoke else 2 if a.quick else 4
    scale = 8 if a.smoke else 1
    names = list(SETTINGS)
    got: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(rounds):
        for i in round_order(len(names), r):
            got[names[i]].append(spawn(names[i], repeats, scale))
    med = {s: {d: statistics.median(x[d] for x in got[s]) for d in DOTS} for s in names}
    rows = [[d, *(f"{med[s][d]:.0f}" for s in names)] for d in DOTS]
    md = markdown_table(["dot (bf16 x bf16 -> float32)", *names], rows) + (
        f"\n\nGFLOP/s, the median over {rounds} round(s) of one child process per setting "
        f"(order rotating), each the median of {repeats} interleaved runs. Flags: "
        + "; ".join(f"{s}: `{f}`" for s, f in SETTINGS.items() if f)
        + "."
    )
    if a.smoke:
        md += " Smoke run (--smoke): dots an eighth the size; the figures mean nothing."
    cmd = (
        "PYTHONPATH=. python benchmarks/xla_dot_libraries.py"
        + (" --smoke" if a.smoke else " --quick" if a.quick else "")
        + (f" --tag {a.tag}" if a.tag else "")
    )
    write_results(
        "xla_dot_libraries" + (f"_{a.tag}" if a.tag else ""),
        {
            "command": cmd,
            "rounds": rounds,
            "repeats": repeats,
            "smoke": a.smoke,
            "gflops": med,
            "samples": got,
        },
        md,
    )
    print(md)


if __name__ == "__main__":
    main()
