"""The XLA:CPU behaviours the backward rules are written around, measured.

Run: ``PYTHONPATH=. python benchmarks/xla_cpu_facts.py [--quick] [--weight-grad-only]``

1. Weight gradient ``x^T g`` (``x [N, K]``, ``g [N, P]``): as XLA emits it (a dot
   contracting the first axis of both; what ``cannjax.ops.linear`` emits), with ``x^T``
   materialized behind an ``optimization_barrier`` (YNNPACK's row-major path), and with
   the smaller operand transposed (what ``linear`` did before it was found to double an
   all-gather under FSDP). Then the whole GPT step (value and gradient) with the weight
   gradients of ``linear``, ``linear_cross_entropy`` and the gated MLPs in the emitted
   form against the smaller-operand form.
2. Matmul throughput by shape: the square ceiling, the GPT's 2-D products, and the
   batched small products of attention (head dim 64), with PyTorch's ``bmm`` alongside
   when it is installed.
3. Attention at the GPT's shapes (fwd+bwd): cannjax, ``jax.nn.dot_product_attention``
   and PyTorch's ``scaled_dot_product_attention`` (when installed).
4. Page faults: minor faults and system time per GPT step, for both JAX models (XLA
   allocates each execution's temp buffer afresh; glibc returns large blocks to the OS),
   with the default allocator and, in a child process, with glibc told to keep freed
   memory (``MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 ...``, set before JAX starts).

Writes ``results/xla_cpu_facts.json`` and ``.md``. See ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import interleaved_times, markdown_table, write_results  # noqa: E402
from gpt import KEEP_FREED, matmul_ceiling, setup, step_fn, training_loop  # noqa: E402

from cannjax import models as gpt  # noqa: E402
from cannjax._src.ops import gated, linalg, linear_cross_entropy  # noqa: E402


def _barrier_t(a):
    return lax.optimization_barrier(a.T)


def smaller_transposed(x2, g2, acc=None):
    """``x2^T g2`` with the smaller operand copied transposed behind a barrier, and a
    barrier on the product so XLA does not fold the final transpose back into the dot."""
    dims = (((1,), (0,)), ((), ()))
    if g2.shape[1] < x2.shape[1]:
        dwt = lax.dot_general(_barrier_t(g2), x2, dims, preferred_element_type=acc)
        return lax.optimization_barrier(dwt).T
    return lax.dot_general(_barrier_t(x2), g2, dims, preferred_element_type=acc)


def weight_grad_forms(repeats):
    rows = []
    for n, k, p in [(2048, 1024, 256), (2048, 256, 1024), (2048, 256, 768)]:
        x = jax.random.normal(jax.random.key(0), (n, k))
        g = jax.random.normal(jax.random.key(1), (n, p))
        forms = {
            "x.T @ g (as emitted)": jax.jit(lambda x, g: x.T @ g),
            "barrier(x.T) @ g": jax.jit(lambda x, g: _barrier_t(x) @ g),
            "smaller operand transposed": jax.jit(smaller_transposed),
        }
        ts = interleaved_times(
            [lambda f=f, x=x, g=g: f(x, g) for f in forms.values()], repeats=repeats
        )
        flop = 2 * n * k * p
        for name, t in zip(forms, ts):
            ms = 1e3 * t["median_s"]
            rows.append([f"[{n},{k}]^T [{n},{p}]", name, f"{ms:.2f}", f"{flop / ms / 1e6:.0f}"])
    return rows


def weight_grad_in_step(repeats):
    """The GPT's ``value_and_grad`` step, compiled once with each weight-gradient form
    (patched into the modules that call ``weight_grad``), timed interleaved."""
    cfg, params, tokens, targets, *_ = setup()
    modules, emitted = (linalg, linear_cross_entropy, gated), linalg.weight_grad
    steps = {}
    for name, form in (("as emitted", emitted), ("smaller operand transposed", smaller_transposed)):
        for m in modules:
            m.weight_grad = form
        loss = lambda p: gpt.gpt_loss(p, tokens, targets, cfg)  # noqa: E731
        steps[name] = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    for m in modules:
        m.weight_grad = emitted
    ts = interleaved_times([lambda f=f: f(params) for f in steps.values()], repeats=repeats)
    base = ts[0]["median_s"]
    return [
        [n, f"{1e3 * t['median_s']:.1f}", f"{t['median_s'] / base:.3f}"] for n, t in zip(steps, ts)
    ]


def batched_weight_grad(repeats):
    """Batched ``a^T g`` (``a [B, M, K]``, ``g [B, M, P]``): as emitted (generic dot)
    against ``a^T`` materialized for YNNPACK."""
    dims = (((1,), (1,)), ((0,), (0,)))
    emitted = jax.jit(lambda a, g: lax.dot_general(a, g, dims))
    copied = jax.jit(
        lambda a, g: lax.dot_general(
            lax.optimization_barrier(jnp.swapaxes(a, 1, 2)), g, (((2,), (1,)), ((0,), (0,)))
        )
    )
    rows = []
    for b, m, k, p in [
        (32, 128, 256, 128),
        (32, 256, 64, 256),
        (16, 256, 256, 256),
        (4, 512, 512, 512),
    ]:
        a = jax.random.normal(jax.random.key(0), (b, m, k))
        g = jax.random.normal(jax.random.key(1), (b, m, p))
        te, tc = interleaved_times(
            [lambda a=a, g=g: emitted(a, g), lambda a=a, g=g: copied(a, g)], repeats=repeats
        )
        rows.append(
            [
                f"[{b},{m},{k}]^T [{b},{m},{p}]",
                f"{1e3 * te['median_s']:.2f}",
                f"{1e3 * tc['median_s']:.2f}",
                f"{m * k * p / 2**20:.0f}",
            ]
        )
    return rows


def matmul_rates(repeats):
    cases = {
        "square 2048": ((2048, 2048), (2048, 2048)),
        "GPT fwd [2048,256]@[256,1024]": ((2048, 256), (256, 1024)),
        "GPT dx [2048,1024]@[1024,256]": ((2048, 1024), (1024, 256)),
        "attention s=qk^T [32,128,64]@[32,64,128]": ((32, 128, 64), (32, 64, 128)),
        "attention pv [32,128,128]@[32,128,64]": ((32, 128, 128), (32, 128, 64)),
        "same flops as 2-D [4096,64]@[64,128]": ((4096, 64), (64, 128)),
    }
    try:
        import torch
    except ImportError:
        torch = None
    rows = []
    for name, (sa, sb) in cases.items():
        a, b = jnp.ones(sa), jnp.ones(sb)
        f = jax.jit(jnp.matmul)
        fns = [lambda f=f, a=a, b=b: f(a, b)]
        if torch is not None:
            ta, tb = torch.ones(sa), torch.ones(sb)
            fns.append(lambda ta=ta, tb=tb: torch.matmul(ta, tb))
        ts = interleaved_times(fns, repeats=repeats)
        flop = 2 * (sa[0] if len(sa) == 3 else 1) * sa[-2] * sa[-1] * sb[-1]
        rate = [f"{flop / t['median_s'] / 1e9:.0f}" for t in ts]
        rows.append([name, rate[0], rate[1] if len(rate) > 1 else "-"])
    return rows


def attention_at_gpt_shapes(repeats):
    from cannjax import ops

    b, t, n, h = 8, 256, 4, 64
    q, k, v = (jax.random.normal(kk, (b, t, n, h)) for kk in jax.random.split(jax.random.key(0), 3))

    def vg(f):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v) * v), (0, 1, 2)))

    fns = {
        "cannjax.ops.attention": vg(lambda q, k, v: ops.attention(q, k, v, causal=True)),
        "jax.nn.dot_product_attention": vg(
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
        ),
    }
    runs = {name: lambda f=f: f(q, k, v) for name, f in fns.items()}
    try:
        import torch

        tq, tk, tv = (torch.randn(b, n, t, h, requires_grad=True) for _ in range(3))

        def torch_sdpa():
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
            (out * tv).sum().backward()
            return out.detach()

        runs["PyTorch scaled_dot_product_attention"] = torch_sdpa
    except ImportError:
        pass
    ts = interleaved_times(list(runs.values()), repeats=repeats)
    return [[name, f"{1e3 * t['median_s']:.1f}"] for name, t in zip(runs, ts)]


def page_faults_both_allocators(steps):
    rows = [["default", *r] for r in page_faults(steps)]
    env = {**os.environ, **KEEP_FREED}
    out = subprocess.run(
        [sys.executable, __file__, "--page-faults-only", str(steps)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    rows += [["keep freed", *r] for r in json.loads(out.strip().splitlines()[-1])]
    return rows


def page_faults(steps):
    cfg, params, tokens, targets, opt, state = setup()
    rows = []
    for name, loss in (("cannjax", gpt.gpt_loss), ("plain JAX", gpt.plain_gpt_loss)):
        step = step_fn(loss, cfg, opt)
        temp = step.lower(params, state, tokens, targets).compile().memory_analysis()
        run = training_loop(step, params, state, tokens, targets)  # step donates its state
        for _ in range(3):
            jax.block_until_ready(run())
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for _ in range(steps):
            jax.block_until_ready(run())
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        rows.append(
            [
                name,
                f"{temp.temp_size_in_bytes / 2**20:.0f}",
                f"{(r1.ru_minflt - r0.ru_minflt) / steps:.0f}",
                f"{1e3 * (r1.ru_stime - r0.ru_stime) / steps:.0f}",
                f"{1e3 * (r1.ru_utime - r0.ru_utime) / steps:.0f}",
                f"{1e3 * (t1 - t0) / steps:.0f}",
            ]
        )
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats")
    p.add_argument(
        "--weight-grad-only",
        action="store_true",
        help="only section 1 (the weight-gradient forms, alone and in the GPT step), "
        "written as results/weight_grad_forms",
    )
    p.add_argument("--page-faults-only", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.page_faults_only:  # the child of page_faults_both_allocators
        print(json.dumps(page_faults(a.page_faults_only)))
        return
    repeats = 7 if a.quick else 21
    wg = weight_grad_forms(repeats)
    ws = weight_grad_in_step(repeats)
    weight_md = [
        "## Weight gradient forms\n\n" + markdown_table(["x^T g", "form", "ms", "GFLOP/s"], wg),
        "## GPT step (value and gradient) by weight-gradient form\n\n"
        + markdown_table(["form", "ms", "vs emitted"], ws),
    ]
    if a.weight_grad_only:
        ceiling = matmul_ceiling()
        md = "\n\n".join(
            [
                "# Weight-gradient forms on XLA:CPU",
                "Command: `PYTHONPATH=. python benchmarks/xla_cpu_facts.py "
                "--weight-grad-only`. Medians of interleaved runs after warm-up. This "
                f"machine's f32 matmul ceiling (square 2048): {ceiling:.0f} GFLOP/s.",
                *weight_md,
            ]
        )
        write_results(
            "weight_grad_forms",
            {"weight_grad": wg, "weight_grad_step": ws, "matmul_ceiling_gflops": ceiling},
            md,
        )
        print(md)
        return
    bw = batched_weight_grad(repeats)
    mm = matmul_rates(repeats)
    at = attention_at_gpt_shapes(repeats)
    pf = page_faults_both_allocators(5 if a.quick else 10)
    md = "\n\n".join(
        [
            "# XLA:CPU facts behind the backward rules",
            "Command: `PYTHONPATH=. python benchmarks/xla_cpu_facts.py`. Medians of "
            "interleaved runs after warm-up.",
            *weight_md,
            "## Batched a^T g (ms)\n\n"
            + markdown_table(["a^T g", "as emitted", "a^T copied", "M K P (Mi)"], bw),
            "## Matmul throughput (GFLOP/s)\n\n"
            + markdown_table(["product", "XLA", "PyTorch"], mm),
            "## Attention fwd+bwd at the GPT's shapes (B=8, T=256, N=4, H=64, causal)\n\n"
            + markdown_table(["implementation", "ms"], at),
            "## Page faults per GPT step (`getrusage`)\n\n"
            "`keep freed`: a child process started with "
            + " ".join(f"`{k}={v}`" for k, v in KEEP_FREED.items())
            + ".\n\n"
            + markdown_table(
                [
                    "allocator",
                    "model",
                    "temp MiB",
                    "minor faults",
                    "system ms",
                    "user ms",
                    "wall ms",
                ],
                pf,
            ),
        ]
    )
    write_results(
        "xla_cpu_facts",
        {
            "weight_grad": wg,
            "weight_grad_step": ws,
            "batched_weight_grad": bw,
            "matmul_gflops": mm,
            "page_faults": pf,
            "repeats": repeats,
        },
        md,
    )
    print(md)


if __name__ == "__main__":
    main()
