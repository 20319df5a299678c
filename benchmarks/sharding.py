"""Sharded training steps: collective bytes and memory per device, cannjax against plain JAX.

Run: ``PYTHONPATH=. python benchmarks/sharding.py [--quick] [--no-paper]``
(``--quick``: small models, two shardings, no compile-only rows; for trying things).

The host's CPU is split into 8 devices (``jax_num_cpu_devices``), meshed ``data x model``
(:func:`cannjax.parallel.model_mesh`); the batch is sharded over ``data`` and the
parameters by :func:`cannjax.parallel.param_shardings`: FSDP over ``data`` (4x2, 8x1),
tensor parallel over ``model`` (1x8; column-parallel, as the rule's default), both (4x2).
Each step is ``jax.jit(jax.value_and_grad(loss), in_shardings=...)``. Figures, per
device, from the compiled program: the bytes its collectives span in one step
(:func:`cannjax.parallel.collective_bytes`: all-gather, all-reduce, reduce-scatter,
all-to-all, collective-permute, a loop's counted per iteration) and its temp memory
(``memory_analysis()``); the gradients of the sharded step against the same model's
single-device step (max relative difference per array, leaving out the arrays whose
gradient is zero in exact arithmetic, found in float64: their float32 rounding noise is
reported apart, over the largest gradient). Step times on 8 CPU devices of a 2-core
machine mean nothing and are not measured.

Rows (issue 25's targets: collective bytes <= 1.0x plain's, temp <= 0.5x, gradients
equal to 1e-5):

1. ``gpt``: ``cannjax.models``' GPT (vocab 1024, width 256, 4 heads, 4 layers, T=256,
   batch 16) written with cannjax operators, and ``cannjax.optimize`` of its plain twin,
   against the plain twin.
2. ``llama``: the Llama-style model (grouped-query attention, RoPE, SwiGLU, RMS norm;
   width 256, 8 heads, 2 kv heads, 4 layers, T=256, batch 16), likewise.
   For both, plain JAX's loss and the cannjax model's also run through
   ``cannjax.parallel.data_parallel(..., param_shardings=...)`` ("via data_parallel": the
   ``shard_map`` gathers FSDP parameters and reduce-scatters their gradients). That row
   is a whole training step (an optimizer whose state is the gradient, so it can be
   compared), so its temp also holds the update and the gathered parameters. The
   cannjax model's also runs with ``reshard_after_forward=True`` ("via data_parallel,
   reshard": its stacked layers gathered one at a time, and again in the backward).
3. ``nnx``: ``benchmarks/_user_models.py``'s flax.nnx GPT (``nnx.split`` state sharded)
   through ``cannjax.optimize`` against itself, with its layers in a list (``nnx``) and
   stacked under ``nnx.scan`` (``nnx_scan``), the two ways flax.nnx users write them.
4. ``vocab``: ``linear_cross_entropy`` with its ``[D, V]`` head sharded 8 ways over the
   vocabulary (N=4096, D=256, V=32768): no all-gather in the program, temp per device
   against 1/8 of the unsharded operator's plus 10%.
5. ``ring``: :func:`cannjax.parallel.ring_attention` over 8 devices at T=32768 (B=1, 8
   heads, head dim 64, causal), compiled only: temp per device of the gradient against
   blockwise attention over the whole sequence on one device (target 1/6); and its
   gradients against that attention's at T=1024. The temps again, compiled in a process
   with XLA:CPU's memory-minimizing scheduler (``MEMORY_SCHEDULER``).
6. ``paper``: compiled only (nothing runs), in a process of 64 and one of 256 host
   devices: a scaled-up GPT (width 1024, 16 heads, 8 layers, vocab 32768, T=1024, 4
   sequences per data shard) under FSDP (Nx1) and FSDP + tensor parallel (N/4 x 4).

Writes ``sharding.{json,md}`` to the results folder (``benchmarks/_harness.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax

if __name__ == "__main__" and "--paper-devices" not in sys.argv:
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import markdown_table, write_results  # noqa: E402

import cannjax  # noqa: E402
from cannjax import parallel  # noqa: E402
from cannjax.models import (  # noqa: E402
    GPTConfig,
    LlamaConfig,
    gpt_loss,
    init_gpt,
    init_llama,
    llama_loss,
    plain_gpt_loss,
    plain_llama_loss,
)

MIB = 2**20
SHARDINGS = {  # name: (data, model, param_shardings keywords)
    "FSDP 4x2": (4, 2, {"fsdp": "data"}),
    "FSDP 8x1": (8, 1, {"fsdp": "data"}),
    "TP 1x8": (1, 8, {"tensor": "model"}),
    "FSDP+TP 4x2": (4, 2, {"fsdp": "data", "tensor": "model"}),
}
QUICK_SHARDINGS = ("FSDP 4x2", "FSDP+TP 4x2")
TARGETS = {"bytes": 1.0, "temp": 0.5, "grad": 1e-5, "vocab_temp": 1.1 / 8, "ring_temp": 1 / 6}


def _rel(a, b, zero=None) -> float:
    """Max over arrays of ``max |a - b| / max |b|``, leaving out those ``zero`` marks
    (:func:`_exact_zeros`)."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(zero or _none(b)))
    return max(
        float(jnp.max(jnp.abs(x - y))) / float(jnp.max(jnp.abs(y))) for x, y, z in pairs if not z
    )


def _none(tree):
    return jax.tree.map(lambda _: False, tree)


def _zero_noise(a, b, zero) -> float:
    """Max over the arrays ``zero`` marks of ``max |a|``, over the largest gradient."""
    largest = max(float(jnp.max(jnp.abs(y))) for y in jax.tree.leaves(b))
    noise = [
        float(jnp.max(jnp.abs(x))) for x, z in zip(jax.tree.leaves(a), jax.tree.leaves(zero)) if z
    ]
    return max(noise, default=0.0) / largest


def _exact_zeros(loss, params, batch):
    """For each gradient array, whether it is zero in exact arithmetic: its float64
    gradient (the same loss and point, one device) is below 1e-6 of the largest. An
    attention key bias is one (softmax ignores a shift of a query's logits): in float32
    it holds rounding noise alone, which no relative difference compares. (Not 0:
    ``jax.nn.dot_product_attention`` computes its softmax in float32 even for float64
    operands. The unrolled flax.nnx GPT's key biases come out at 3.5e-9 to 5.3e-9 of
    the largest gradient there, every other array above 6.6e-3.)"""
    with jax.enable_x64(True):
        wide = jax.tree.map(
            lambda x: x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x,
            params,
        )
        grads = jax.jit(jax.grad(loss))(wide, batch)
        peaks = [float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads)]
    return jax.tree.unflatten(jax.tree.structure(grads), [p <= 1e-6 * max(peaks) for p in peaks])


def _measure(loss, params, batch, mesh, kw, reference) -> dict[str, Any]:
    shardings = parallel.param_shardings(params, mesh, **kw)
    rows = NamedSharding(mesh, P("data"))
    in_shardings = (shardings, jax.tree.map(lambda _: rows, batch))
    step = jax.jit(jax.value_and_grad(loss), in_shardings=in_shardings)
    compiled = step.lower(params, batch).compile()
    got = compiled(params, batch)
    return {
        "collective_bytes": parallel.collective_bytes(compiled),
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        **_grad_figures(got[1], reference),
    }


def _measure_data_parallel(
    loss, params, batch, mesh, kw, reference, reshard: bool = False
) -> dict[str, Any]:
    """The same, through ``data_parallel(..., param_shardings=...)``: a whole training
    step whose optimizer state is the averaged gradient (``optax.trace(decay=0)``, the
    update scaled to zero), so the gradients can be compared. ``reshard``: with
    ``reshard_after_forward=True`` (FSDP layer by layer)."""
    shardings = parallel.param_shardings(params, mesh, **kw)
    opt = optax.chain(optax.trace(decay=0.0), optax.scale(0.0))
    step = parallel.data_parallel(
        loss, opt, param_shardings=shardings, reshard_after_forward=reshard
    )
    placed = jax.device_put(params, shardings)
    state = jax.jit(opt.init)(placed)
    compiled = step.lower(placed, state, batch).compile()
    got = step(placed, state, batch)
    return {
        "collective_bytes": parallel.collective_bytes(compiled),
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        **_grad_figures(got.opt_state[0].trace, reference),
    }


def _grad_figures(grads, reference) -> dict[str, float]:
    """``reference``: ``(value, grads, zero)`` of the single-device step."""
    _, want, zero = reference
    return {
        "grad_rel_to_single_device": _rel(grads, want, zero),
        "grad_exact_zero_noise": _zero_noise(grads, want, zero),
    }


def _model_rows(
    name, variants, params, batch, shardings, dp_variants=(), wide=None
) -> dict[str, Any]:
    """``variants``: {label: loss(params, batch)}; the first is the baseline. Labels in
    ``dp_variants`` are also run through ``data_parallel`` (label + " via data_parallel").
    ``wide``: the baseline's loss for float64 parameters, where it differs."""
    out = {}
    zero = _exact_zeros(wide or next(iter(variants.values())), params, batch)
    single = {
        label: (*jax.jit(jax.value_and_grad(f))(params, batch), zero)
        for label, f in variants.items()
    }
    for sname in shardings:
        data, model, kw = SHARDINGS[sname]
        mesh = parallel.model_mesh(data, model)
        t0 = time.perf_counter()
        out[sname] = {
            label: _measure(f, params, batch, mesh, kw, single[label])
            for label, f in variants.items()
        }
        for label in dp_variants if data > 1 else ():  # data_parallel needs a data axis
            out[sname][f"{label} via data_parallel"] = _measure_data_parallel(
                variants[label], params, batch, mesh, kw, single[label]
            )
            if label != next(iter(variants)):  # the cannjax model, FSDP layer by layer
                out[sname][f"{label} via data_parallel, reshard"] = _measure_data_parallel(
                    variants[label], params, batch, mesh, kw, single[label], reshard=True
                )
        base = out[sname][next(iter(variants))]
        for m in out[sname].values():
            m["bytes_ratio"] = m["collective_bytes"]["total"] / max(
                base["collective_bytes"]["total"], 1
            )
            m["temp_ratio"] = m["temp_bytes"] / base["temp_bytes"]
        print(f"{name} {sname}: {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def _twin_rows(name, label, cfg, init, loss, plain_loss, shardings) -> dict[str, Any]:
    """A ``cannjax.models`` model and its plain twin (also through ``optimize``)."""
    params = init(jax.random.key(0), cfg)
    toks = jax.random.randint(jax.random.key(1), (16, cfg.seq_len + 1), 0, cfg.vocab)
    batch = (toks[:, :-1], toks[:, 1:])
    variants = {
        "plain JAX": lambda p, b: plain_loss(p, *b, cfg),
        label: lambda p, b: loss(p, *b, cfg),
        "plain + optimize": cannjax.optimize(lambda p, b: plain_loss(p, *b, cfg)),
    }
    return _model_rows(name, variants, params, batch, shardings, ("plain JAX", label))


def gpt_rows(quick: bool, shardings) -> dict[str, Any]:
    cfg = GPTConfig(vocab=1024, width=256, heads=4, layers=4, seq_len=256)
    if quick:
        cfg = GPTConfig(vocab=256, width=64, heads=4, layers=2, seq_len=64)
    return _twin_rows("gpt", "cannjax GPT", cfg, init_gpt, gpt_loss, plain_gpt_loss, shardings)


def llama_rows(quick: bool, shardings) -> dict[str, Any]:
    cfg = LlamaConfig(vocab=1024, width=256, heads=8, kv_heads=2, layers=4, seq_len=256,
                      hidden=704)  # fmt: skip
    if quick:
        cfg = LlamaConfig(vocab=256, width=64, heads=4, kv_heads=2, layers=2, seq_len=64,
                          hidden=192)  # fmt: skip
    return _twin_rows(
        "llama", "cannjax Llama", cfg, init_llama, llama_loss, plain_llama_loss, shardings
    )


def nnx_rows(quick: bool, shardings, scan: bool = False) -> dict[str, Any]:
    from _user_models import NnxGPT, Shape, nnx_loss
    from flax import nnx

    s = (
        Shape(vocab=256, width=64, heads=4, layers=2, seq_len=64, batch=16)
        if quick
        else Shape(batch=16)
    )
    graphdef, state = nnx.split(NnxGPT(s, scan=scan, rngs=nnx.Rngs(0)))
    toks = jax.random.randint(jax.random.key(1), (s.batch, s.seq_len + 1), 0, s.vocab)
    batch = (toks[:, :-1], toks[:, 1:])

    def loss(state, b):
        return nnx_loss(nnx.merge(graphdef, state), *b)

    def wide(state, b):  # flax.nnx's Embed computes in float32 unless told otherwise
        model = nnx.merge(graphdef, state)
        for _, module in nnx.iter_modules(model):
            if getattr(module, "dtype", None) is not None:
                module.dtype = jnp.float64
        return nnx_loss(model, *b)

    variants = {"flax.nnx": loss, "flax.nnx + optimize": cannjax.optimize(loss)}
    name = "nnx_scan" if scan else "nnx"
    return _model_rows(name, variants, state, batch, shardings, wide=wide)


MODELS = {
    "gpt": gpt_rows,
    "llama": llama_rows,
    "nnx": nnx_rows,
    "nnx_scan": functools.partial(nnx_rows, scan=True),
}


def vocab_row(quick: bool) -> dict[str, Any]:
    N, D, V = (512, 64, 4096) if quick else (4096, 256, 32768)
    mesh = parallel.model_mesh(1, 8)
    args = (
        jax.ShapeDtypeStruct((N, D), jnp.float32),
        jax.ShapeDtypeStruct((D, V), jnp.float32),
        jax.ShapeDtypeStruct((N,), jnp.int32),
    )
    out = {}
    for label, kw in {"plain": {}, "smoothing+z_loss+cap": {
            "label_smoothing": 0.1, "z_loss": 1e-4, "logit_cap": 30.0}}.items():  # fmt: skip

        def loss(x, w, y, kw=kw):
            return cannjax.ops.linear_cross_entropy(x, w, y, **kw).mean()

        def compiled(head, loss=loss):
            rep = NamedSharding(mesh, P())
            f = jax.jit(jax.value_and_grad(loss, (0, 1)), in_shardings=(rep, head, rep))
            return f.lower(*args).compile()

        sharded = compiled(NamedSharding(mesh, P(None, "model")))
        whole = compiled(NamedSharding(mesh, P()))
        t_s = sharded.memory_analysis().temp_size_in_bytes
        t_w = whole.memory_analysis().temp_size_in_bytes
        out[label] = {
            "all_gathers": sharded.as_text().count(" all-gather("),
            "collective_bytes": parallel.collective_bytes(sharded),
            "temp_bytes": int(t_s),
            "unsharded_temp_bytes": int(t_w),
            "temp_ratio": t_s / t_w,
        }
    return {"N": N, "D": D, "V": V, "variants": out}


def ring_row(quick: bool, with_grads: bool = True) -> dict[str, Any]:
    from cannjax.ops import attention

    T, N, H = (4096, 4, 32) if quick else (32768, 8, 64)
    mesh = parallel.model_mesh(8, 1, axis_names=("seq", "unused"))
    spec = P(None, "seq")

    def ring(q, k, v):
        f = jax.shard_map(
            lambda q, k, v: parallel.ring_attention(q, k, v, "seq", causal=True),
            mesh=mesh, in_specs=spec, out_specs=spec,
        )  # fmt: skip
        return f(q, k, v)

    def whole(q, k, v):
        return attention(q, k, v, causal=True)

    def temp(f, T):
        x = jax.ShapeDtypeStruct((1, T, N, H), jnp.float32)
        g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)), (0, 1, 2)))
        return int(g.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes)

    t_ring, t_whole = temp(ring, T), temp(whole, T)
    out = {"T": T, "heads": N, "head_dim": H, "temp_bytes": t_ring,
           "unsharded_temp_bytes": t_whole, "temp_ratio": t_ring / t_whole}  # fmt: skip
    if not with_grads:
        return out
    small = [jax.random.normal(jax.random.key(i), (1, 1024, N, H)) for i in range(3)]

    def grads(f):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))), (0, 1, 2)))(*small)

    return {**out, "grad_rel_at_T1024": _rel(grads(ring), grads(whole))}


def paper(devices: int) -> dict[str, Any]:
    """Compile-only rows on ``devices`` host devices (run in a process of its own)."""
    cfg = GPTConfig(vocab=32768, width=1024, heads=16, layers=8, seq_len=1024)
    params = jax.eval_shape(lambda: init_gpt(jax.random.key(0), cfg))
    out = {}
    for label, (data, model, kw) in {
        f"FSDP {devices}x1": (devices, 1, {"fsdp": "data"}),
        f"FSDP+TP {devices // 4}x4": (devices // 4, 4, {"fsdp": "data", "tensor": "model"}),
    }.items():
        mesh = parallel.model_mesh(data, model)
        toks = jax.ShapeDtypeStruct((4 * data, cfg.seq_len), jnp.int32)
        rows = NamedSharding(mesh, P("data"))
        shardings = parallel.param_shardings(params, mesh, **kw)
        out[label] = {}
        for name, loss in {"plain JAX": plain_gpt_loss, "cannjax GPT": gpt_loss}.items():
            t0 = time.perf_counter()
            step = jax.jit(
                jax.value_and_grad(lambda p, t, loss=loss: loss(p, t, t, cfg)),
                in_shardings=(shardings, rows),
            )
            c = step.lower(params, toks).compile()
            out[label][name] = {
                "collective_bytes": parallel.collective_bytes(c),
                "temp_bytes": int(c.memory_analysis().temp_size_in_bytes),
                "compile_s": round(time.perf_counter() - t0, 1),
            }
            print(f"paper {label} {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def _in_subprocess(call: str, devices: int, xla_flags: str = "") -> Any:
    """``sharding.<call>`` in a fresh process of ``devices`` host devices (and extra
    ``XLA_FLAGS``, which XLA reads once per process); its JSON result."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    if xla_flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
    code = (
        "import jax, json, sys; "
        f"jax.config.update('jax_num_cpu_devices', {devices}); "
        "sys.path.insert(0, 'benchmarks'); import sharding; "
        f"print('RESULT' + json.dumps(sharding.{call}))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=3000,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    if r.returncode:
        raise RuntimeError(f"{call} on {devices} devices failed:\n{r.stderr[-3000:]}")
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


# XLA:CPU's default scheduler orders the program for concurrency; this flag selects the
# memory-minimizing one (the ring row is compiled under both).
MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def markdown(res: dict[str, Any]) -> str:
    head = ["model", "sharding", "variant", "collectives MiB/step", "x plain", "temp MiB",
            "x plain", "grad rel. diff", "targets met"]  # fmt: skip
    rows = []
    for model in MODELS:
        for sname, variants in res.get(model, {}).items():
            for label, m in variants.items():
                first = label == next(iter(variants))
                met = "" if first else _met(m)
                rows.append([model, sname, label, f"{m['collective_bytes']['total'] / MIB:.1f}",
                             f"{m['bytes_ratio']:.2f}", f"{m['temp_bytes'] / MIB:.1f}",
                             f"{m['temp_ratio']:.2f}",
                             f"{m['grad_rel_to_single_device']:.1e}", met])  # fmt: skip
    parts = [markdown_table(head, rows)]
    noise = [(m.get("grad_exact_zero_noise", 0.0), model) for model in MODELS
             for variants in res.get(model, {}).values() for m in variants.values()]  # fmt: skip
    if any(n for n, _ in noise):
        worst, where = max(noise)
        parts.append(
            "Gradient differences leave out the arrays whose gradient is zero in exact "
            "arithmetic (below 1e-6 of the largest in float64; an attention's key bias is one: "
            "softmax ignores a shift of a row). Those hold float32 rounding noise, at most "
            f"{worst:.1e} of the largest gradient ({where})."
        )
    v = res.get("vocab")
    if v:
        vr = [[k, m["all_gathers"], f"{m['collective_bytes']['total'] / MIB:.1f}",
               f"{m['temp_bytes'] / MIB:.1f}", f"{m['unsharded_temp_bytes'] / MIB:.1f}",
               f"{m['temp_ratio']:.3f} (target <= {TARGETS['vocab_temp']:.3f})"]
              for k, m in v["variants"].items()]  # fmt: skip
        parts.append(
            f"Vocabulary-parallel linear_cross_entropy, N={v['N']}, D={v['D']}, V={v['V']}, "
            "head sharded 8 ways:\n\n"
            + markdown_table(
                [
                    "options",
                    "all-gathers",
                    "collectives MiB",
                    "temp MiB",
                    "unsharded temp MiB",
                    "ratio",
                ],
                vr,
            )  # fmt: skip
        )
    r = res.get("ring")
    if r:
        parts.append(
            f"Ring attention over 8 devices, T={r['T']}, {r['heads']} heads, head dim "
            f"{r['head_dim']}, causal: gradient temp per device {r['temp_bytes'] / MIB:.1f} "
            f"MiB against {r['unsharded_temp_bytes'] / MIB:.1f} MiB for blockwise attention "
            f"on one device ({r['temp_ratio']:.3f}x; target <= {TARGETS['ring_temp']:.3f}); "
            f"gradients at T=1024 differ by {r['grad_rel_at_T1024']:.1e} (relative)."
        )
        m = r.get("memory_scheduler")
        if m:
            parts[-1] += (
                f" Compiled with XLA:CPU's memory-minimizing scheduler (`{MEMORY_SCHEDULER}`"
                f"): {m['temp_bytes'] / MIB:.1f} MiB against {m['unsharded_temp_bytes'] / MIB:.1f}"
                f" MiB ({m['temp_ratio']:.3f}x)."
            )
    for devices, labels in sorted(res.get("paper", {}).items(), key=lambda kv: int(kv[0])):
        pr = []
        for label, variants in labels.items():
            base = variants["plain JAX"]
            for name, m in variants.items():
                moved, base_moved = (
                    m["collective_bytes"]["total"],
                    base["collective_bytes"]["total"],
                )
                pr.append([devices, label, name, f"{moved / MIB:.0f}", f"{moved / base_moved:.2f}",
                           f"{m['temp_bytes'] / MIB:.0f}",
                           f"{m['temp_bytes'] / base['temp_bytes']:.2f}"])  # fmt: skip
        parts.append(
            f"Compiled only, {devices} host devices (GPT width 1024, 8 layers, vocab 32768, "
            "T=1024, 4 sequences per data shard):\n\n"
            + markdown_table(
                [
                    "devices",
                    "sharding",
                    "model",
                    "collectives MiB/step",
                    "x plain",
                    "temp MiB",
                    "x plain",
                ],
                pr,
            )  # fmt: skip
        )
    return "\n\n".join(parts)


def _met(m) -> str:
    ok = [m["bytes_ratio"] <= TARGETS["bytes"], m["temp_ratio"] <= TARGETS["temp"],
          m["grad_rel_to_single_device"] <= TARGETS["grad"]]  # fmt: skip
    return f"{sum(ok)}/3" + ("" if all(ok) else " (" + ", ".join(
        n for n, o in zip(("bytes", "temp", "grad"), ok) if not o) + " missed)")  # fmt: skip


def main(argv=None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small models, two shardings")
    p.add_argument("--no-paper", action="store_true", help="skip the 64/256-device rows")
    p.add_argument("--paper-devices", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if len(jax.devices()) != 8:
        p.error(f"needs 8 host devices (jax_num_cpu_devices), got {len(jax.devices())}")
    shardings = QUICK_SHARDINGS if a.quick else tuple(SHARDINGS)
    res: dict[str, Any] = {}
    for name, fn in MODELS.items():
        res[name] = fn(a.quick, shardings)
    res["vocab"] = vocab_row(a.quick)
    res["ring"] = ring_row(a.quick)
    res["ring"]["memory_scheduler"] = _in_subprocess(
        f"ring_row({a.quick}, with_grads=False)", 8, MEMORY_SCHEDULER
    )
    if not (a.quick or a.no_paper):
        res["paper"] = {str(n): _in_subprocess(f"paper({n})", n) for n in (64, 256)}
    command = "PYTHONPATH=. python benchmarks/sharding.py" + " --quick" * a.quick
    command += " --no-paper" * a.no_paper
    table = markdown(res)
    print(table)
    write_results("sharding", {"command": command, "targets": TARGETS, **res}, table)
    return res


if __name__ == "__main__":
    main()
