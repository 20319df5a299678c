"""cannjax linear algebra and normalization ops against plain JAX autodiff, side by side.

Three suites, each timed in one process with plain JAX and cannjax interleaved
(A B A B ...) after warm-up, median of the rounds, with the spread:

(a) ``mlp``: gradient of a 2-layer MLP, ``loss = sum(y**2)``, ``x [B, T, D]`` (rank 3),
    ``y = act(x @ w1) @ w2``, with and without gelu (``cannjax.ops.gelu`` /
    ``jax.nn.gelu``, both the tanh form).
(b) ``stack``: gradient of 16 blocks ``x = layer_norm(gelu(x @ W))`` on ``x [256, 1024]``,
    under ``lax.scan`` over stacked weights and as an unrolled Python loop over per-layer
    weights: compiled temp memory (``memory_analysis().temp_size_in_bytes``) and time.
(c) ``ops``: per-op forward+backward time and residual bytes (``cannjax.inspect``)
    against plain autodiff of the op's reference.

Run: ``PYTHONPATH=. python benchmarks/nn_ops.py`` (``--quick``: smaller sizes, fewer
rounds). Writes ``nn_ops.json`` and ``.md``
to the results folder (``build/bench/results/``, or ``benchmarks/results/`` under
``cannjax bench --write``: see ``benchmarks/_harness.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import platform
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _harness import RESULTS, interleaved_times  # noqa: E402

import cannjax  # noqa: E402
from cannjax.core import registry  # noqa: E402
from cannjax.inspect import compiled_memory, residuals  # noqa: E402

MIB = 2**20


# ------------------------------------------------------------------------------ timing
def interleaved(fns: dict[str, Callable], args: tuple, rounds: int, warmup: int = 2) -> dict:
    """Median and quartiles (ms) of each jitted ``fns[k](*args)``, run A B A B ..."""
    res = interleaved_times(
        [functools.partial(f, *args) for f in fns.values()],
        repeats=rounds,
        warmup=warmup,
        samples=True,
        cpu_time=True,
    )
    times = {k: [1e3 * t for t in r["samples_s"]] for k, r in zip(fns, res)}
    cpu = {k: [1e3 * t for t in r["cpu_samples_s"]] for k, r in zip(fns, res)}
    out = {
        k: {
            "median_ms": float(np.median(v)),
            "p25_ms": float(np.percentile(v, 25)),
            "p75_ms": float(np.percentile(v, 75)),
            "cpu_median_ms": float(np.median(cpu[k])),
        }
        for k, v in times.items()
    }
    if set(fns) >= {"plain", "cannjax"}:
        per_round = np.asarray(times["cannjax"]) / np.asarray(times["plain"])
        out["time_ratio"] = out["cannjax"]["median_ms"] / out["plain"]["median_ms"]
        out["cpu_time_ratio"] = out["cannjax"]["cpu_median_ms"] / out["plain"]["cpu_median_ms"]
        out["round_ratio_min_median_max"] = [
            float(per_round.min()),
            float(np.median(per_round)),
            float(per_round.max()),
        ]
    return out


# ------------------------------------------------------------------------------ (a) MLP
def mlp_loss(kind: str, act: bool) -> Callable:
    """``sum((act(x @ w1) @ w2)**2)`` written with plain JAX or cannjax ops."""
    if kind == "plain":

        def loss(x, w1, w2):
            h = x @ w1
            h = jax.nn.gelu(h) if act else h
            return jnp.sum((h @ w2) ** 2)

    else:

        def loss(x, w1, w2):
            h = cannjax.ops.linear(x, w1)
            h = cannjax.ops.gelu(h) if act else h
            return jnp.sum(cannjax.ops.linear(h, w2) ** 2)

    return loss


def bench_mlp(b: int, t: int, d: int, h: int, rounds: int) -> dict:
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (b, t, d), jnp.float32)
    w1 = jax.random.normal(k[1], (d, h), jnp.float32) / np.sqrt(d)
    w2 = jax.random.normal(k[2], (h, d), jnp.float32) / np.sqrt(h)
    flops = 3 * 2 * (2 * b * t * d * h)  # forward + two backward products per layer
    out = {"sizes": {"B": b, "T": t, "D": d, "H": h}, "gflop": flops / 1e9}
    for act in (False, True):
        fns = {
            kind: jax.jit(jax.grad(mlp_loss(kind, act), argnums=(0, 1, 2)))
            for kind in ("plain", "cannjax")
        }
        res = interleaved(fns, (x, w1, w2), rounds)
        res["speedup"] = 1 / res["time_ratio"]
        res["cannjax_gflops"] = flops / 1e6 / res["cannjax"]["median_ms"]
        out["gelu" if act else "linear"] = res
    return out


# ------------------------------------------------------------------------------ (b) stack
def _layer_norm_plain(x, s, b, eps=1e-5):
    m = jnp.mean(x, axis=-1, keepdims=True)
    v = jnp.mean((x - m) ** 2, axis=-1, keepdims=True)
    return (x - m) / jnp.sqrt(v + eps) * s[None] + b[None]


def block(kind: str, x, w, s, b):
    """One block ``layer_norm(gelu(x @ w))``, plain JAX or cannjax ops."""
    if kind == "plain":
        return _layer_norm_plain(jax.nn.gelu(x @ w), s, b)
    return cannjax.ops.layer_norm(cannjax.ops.gelu(cannjax.ops.linear(x, w)), s, b)


def stack_loss(kind: str, form: str) -> Callable:
    """``sum(y**2)`` of the block stack; ``form`` is ``"scan"`` (stacked weights
    ``W [L, D, D]``, ``s, b [L, D]``) or ``"loop"`` (lists of per-layer arrays)."""
    if form == "scan":

        def loss(x, ws, ss, bs):
            y, _ = jax.lax.scan(lambda c, p: (block(kind, c, *p), None), x, (ws, ss, bs))
            return jnp.sum(y**2)

    else:

        def loss(x, ws, ss, bs):
            for w, s, b in zip(ws, ss, bs):
                x = block(kind, x, w, s, b)
            return jnp.sum(x**2)

    return loss


def stack_args(layers: int, batch: int, width: int, form: str) -> tuple:
    k = jax.random.split(jax.random.key(1), 2)
    x = jax.random.normal(k[0], (batch, width), jnp.float32)
    ws = jax.random.normal(k[1], (layers, width, width), jnp.float32) / np.sqrt(width)
    ss = jnp.ones((layers, width), jnp.float32)
    bs = jnp.zeros((layers, width), jnp.float32)
    if form == "loop":
        return x, list(ws), list(ss), list(bs)
    return x, ws, ss, bs


def stack_grad(kind: str, form: str) -> Callable:
    return jax.grad(stack_loss(kind, form), argnums=(0, 1, 2, 3))


def stack_memory(layers: int, batch: int, width: int, form: str) -> dict:
    """Compiled temp memory (bytes) of the stack's gradient, plain and cannjax."""
    args = stack_args(layers, batch, width, form)
    return {
        kind: compiled_memory(stack_grad(kind, form), *args).temp_bytes
        for kind in ("plain", "cannjax")
    }


def bench_stack(layers: int, batch: int, width: int, rounds: int) -> dict:
    out = {"sizes": {"layers": layers, "batch": batch, "width": width}}
    for form in ("scan", "loop"):
        args = stack_args(layers, batch, width, form)
        mem = stack_memory(layers, batch, width, form)
        fns = {kind: jax.jit(stack_grad(kind, form)) for kind in ("plain", "cannjax")}
        res = interleaved(fns, args, rounds)
        res["temp_mib"] = {k: v / MIB for k, v in mem.items()}
        res["memory_ratio"] = mem["cannjax"] / mem["plain"]
        out[form] = res
    return out


# ------------------------------------------------------------------------------ (c) per op
def op_cases(quick: bool) -> dict[str, tuple]:
    """Arguments of each op at benchmark size."""
    n, d = (512, 512) if quick else (2048, 1024)
    k = jax.random.split(jax.random.key(2), 6)
    x3 = jax.random.normal(k[0], (8, n // 8, d), jnp.float32)
    w = jax.random.normal(k[1], (d, d), jnp.float32) / np.sqrt(d)
    bias = jax.random.normal(k[2], (d,), jnp.float32)
    bm = 16 if quick else 32
    a = jax.random.normal(k[3], (bm, 128, 256), jnp.float32)
    b = jax.random.normal(k[4], (bm, 256, 128), jnp.float32)
    x = jax.random.normal(k[5], (n, d), jnp.float32)
    scale = 1 + 0.1 * bias
    return {
        "linear": (x3, w, bias),
        "matmul": (a, b),
        "layer_norm": (x, scale, bias),
        "rms_norm": (x, scale),
    }


def _weighted(f: Callable, out_like: jax.Array) -> Callable:
    c = jax.random.normal(jax.random.key(3), out_like.shape, out_like.dtype)
    return lambda *a: jnp.sum(f(*a) * c)


def op_residual_bytes(name: str, args: tuple) -> dict:
    """Residual bytes of ``sum(c * op(args))``: cannjax against plain autodiff."""
    spec = registry()[name]
    out = spec.fn(*args)
    ours = residuals(_weighted(spec.fn, out), *args)
    plain = residuals(_weighted(spec.reference, out), *args)
    return {"cannjax": ours.total_bytes, "plain": plain.total_bytes}


def bench_ops(quick: bool, rounds: int) -> dict:
    out = {}
    for name, args in op_cases(quick).items():
        spec = registry()[name]
        y = spec.fn(*args)
        argnums = tuple(range(len(args)))
        fns = {
            "plain": jax.jit(jax.grad(_weighted(spec.reference, y), argnums=argnums)),
            "cannjax": jax.jit(jax.grad(_weighted(spec.fn, y), argnums=argnums)),
        }
        res = interleaved(fns, args, rounds)
        res["shapes"] = [list(a.shape) for a in args]
        res["residual_bytes"] = op_residual_bytes(name, args)
        out[name] = res
    return out


# ------------------------------------------------------------------------------ report
def _t(r: dict, k: str) -> str:
    v = r[k]
    return f"{v['median_ms']:.1f} ({v['p25_ms']:.1f}-{v['p75_ms']:.1f})"


def markdown(results: dict) -> str:
    cmd = "PYTHONPATH=. python benchmarks/nn_ops.py" + (" --quick" if results["quick"] else "")
    lines = [
        "# nn_ops: linear algebra and normalization against plain JAX",
        "",
        f"Command: `{cmd}`; {results['machine']}. Times: median ms (quartiles) of "
        f"{results['rounds']} interleaved rounds; ratio = cannjax / plain (per-round "
        "min / median / max in brackets); CPU time is the process's (all threads), less "
        "sensitive to other jobs on the shared cores than wall time. Memory is "
        "deterministic; times are not.",
        "",
    ]
    m = results["mlp"]
    s = m["sizes"]
    lines += [
        f"## (a) 2-layer MLP gradient, x [{s['B']}, {s['T']}, {s['D']}], hidden {s['H']}, "
        f"{m['gflop']:.1f} GFLOP",
        "",
        "| variant | plain ms | cannjax ms | speedup | speedup, CPU time | cannjax GFLOP/s "
        "| per-round ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in ("linear", "gelu"):
        r = m[v]
        rr = ", ".join(f"{x:.2f}" for x in r["round_ratio_min_median_max"])
        lines.append(
            f"| {v} | {_t(r, 'plain')} | {_t(r, 'cannjax')} | {r['speedup']:.2f}x | "
            f"{1 / r['cpu_time_ratio']:.2f}x | {r['cannjax_gflops']:.0f} | [{rr}] |"
        )
    st = results["stack"]
    s = st["sizes"]
    lines += [
        "",
        f"## (b) {s['layers']} blocks `layer_norm(gelu(x @ W))`, x [{s['batch']}, "
        f"{s['width']}], gradient",
        "",
        "| form | plain temp MiB | cannjax temp MiB | memory ratio | plain ms | cannjax ms "
        "| time ratio | CPU-time ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for form in ("scan", "loop"):
        r = st[form]
        rr = ", ".join(f"{x:.2f}" for x in r["round_ratio_min_median_max"])
        lines.append(
            f"| {form} | {r['temp_mib']['plain']:.1f} | {r['temp_mib']['cannjax']:.1f} | "
            f"{r['memory_ratio']:.2f} | {_t(r, 'plain')} | {_t(r, 'cannjax')} | "
            f"{r['time_ratio']:.2f} [{rr}] | {r['cpu_time_ratio']:.2f} |"
        )
    lines += [
        "",
        "## (c) per op, forward + backward (jit), residual bytes",
        "",
        "| op | shapes | plain ms | cannjax ms | time ratio | CPU-time ratio | plain residual "
        "bytes | cannjax residual bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results["ops"].items():
        rb = r["residual_bytes"]
        rr = ", ".join(f"{x:.2f}" for x in r["round_ratio_min_median_max"])
        lines.append(
            f"| {name} | {r['shapes']} | {_t(r, 'plain')} | {_t(r, 'cannjax')} | "
            f"{r['time_ratio']:.2f} [{rr}] | {r['cpu_time_ratio']:.2f} | {rb['plain']:,} | "
            f"{rb['cannjax']:,} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer rounds")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per comparison")
    p.add_argument("--only", choices=("mlp", "stack", "ops"), default=None)
    a = p.parse_args(argv)
    rounds = a.rounds or (4 if a.quick else 10)
    results = {
        "quick": a.quick,
        "rounds": rounds,
        "machine": f"{platform.machine()}, {jax.devices()[0].device_kind}, jax {jax.__version__}",
    }
    if a.only in (None, "mlp"):
        sizes = (4, 128, 512, 512) if a.quick else (8, 256, 1024, 1024)
        results["mlp"] = bench_mlp(*sizes, rounds)
        print("mlp", json.dumps(results["mlp"], indent=1))
    if a.only in (None, "stack"):
        sizes = (4, 256, 512) if a.quick else (16, 256, 1024)
        results["stack"] = bench_stack(*sizes, rounds)
        print("stack", json.dumps(results["stack"], indent=1))
    if a.only in (None, "ops"):
        results["ops"] = bench_ops(a.quick, rounds)
        print("ops", json.dumps(results["ops"], indent=1))
    if a.only is None:
        RESULTS.mkdir(parents=True, exist_ok=True)
        suffix = "_quick" if a.quick else ""
        (RESULTS / f"nn_ops{suffix}.json").write_text(json.dumps(results, indent=1) + "\n")
        (RESULTS / f"nn_ops{suffix}.md").write_text(markdown(results))
    return results


if __name__ == "__main__":
    main()
