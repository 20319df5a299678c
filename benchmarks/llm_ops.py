"""The LLM operators against the plain-JAX forms users write: memory, time, targets.

Run: ``PYTHONPATH=. python benchmarks/llm_ops.py [--quick] [--rows NAME ...] [--docs]``
(``--quick``: small sizes and 3 timed rounds, for trying things; ``--table FILE``
prints the markdown of a recorded ``llm_ops.json`` without measuring; ``--docs``
replaces the table of ``docs/llm_ops.md`` with a full run's, or with ``--table``'s).

Each row puts a cannjax form beside the baseline a user writes, in one process, and
records the target of issue 23 ("Targets") and whether it was met:

1. ``gqa``: grouped-query attention with soft-capping and a sliding window (B=1, 8
   query heads, 2 key/value heads, T=4096, head dim 64, causal, ``logit_cap=50``,
   ``window=(1024, 0)``) against the same math written out (``jnp.repeat`` of k and v,
   ``cap * tanh(s / cap)``, the causal-and-window mask, ``jax.nn.softmax``): compiled temp
   memory of the gradient <= 1/16, and the time ratio. ``jax.nn.dot_product_attention``
   has no soft-cap, so it cannot compute this row; its temp memory with the window and
   without the cap is shown beside it for comparison.
2. ``window``: ``window=(512, 0)`` (with ``causal``) against cannjax's own full causal
   attention, T=4096, the heads and head dim of row 1:
   time of the backward alone (the pullback of a jitted ``jax.vjp``) <= 0.35x.
3. ``packed``: 4 packed sequences of unequal lengths in T=4096, ``segment_ids`` with
   ``causal`` against the same attention with a dense block-diagonal boolean mask:
   forward + backward time <= 0.4x.
4. ``rope``: the residuals of ``rope`` alone must be the positions only; the step
   (``value_and_grad`` of a squared error) of a layer ``x -> q, k, v -> rope(q), rope(k)
   -> causal GQA attention -> output projection`` against the same layer with HF-Llama's
   ``rotate_half`` rope and ``jax.nn.dot_product_attention``: time <= 0.9x.
5. ``swiglu``: ``(silu(x w_gate) * (x w_up)) w_down``, N=4096, D=1024, hidden 2816:
   residual bytes <= 0.6x plain autodiff; gradient time and temp memory.
6. ``lce``: ``linear_cross_entropy`` with ``label_smoothing=0.1`` and ``z_loss=1e-4``,
   N=4096, D=256, V=32768, against ``x @ w`` then ``optax.smooth_labels`` +
   ``optax.softmax_cross_entropy`` + ``z_loss * logsumexp**2``: value_and_grad temp
   memory <= 0.25x, for the per-row loss then ``.mean()`` and for ``reduction="mean"``;
   time ratios.
7. ``llama``: one training step (``value_and_grad`` + ``optax.adam``) of
   ``cannjax.models``' Llama-style model (4 layers, width 256, 8 heads, 2 kv heads,
   T=512, B=4) against its plain-JAX twin: speed-up >= 1.5x, temp memory <= 0.5x, max
   relative gradient difference <= 1e-5.
8. ``jsd``: ``linear_jensen_shannon`` (student ``x @ w``, teacher ``tx @ tw``, neither
   ``[N, V]`` held) against plain JAX with both logits materialized: value_and_grad
   temp memory and time (no target in the issue).

Rows 1-3 differentiate ``out.sum()`` (as ``benchmarks/attention.py``); rows 5, 6 and 8
a loss with a random cotangent or their own mean. Where both sides compute the same
math, the largest relative difference of their gradients (``max |a - b| / max |b|`` per
array) is recorded as a sanity line (<= 1e-4 in float32): a baseline written with a
different convention would show there. Memory: ``compiled.memory_analysis()`` temp bytes
and ``cannjax.inspect.residuals`` (deterministic). Times: the compared programs compiled
once, then run interleaved (A B A B ...) after warm-up, medians of >= 10 rounds (3 with
``--quick``), reported as ratios with the [min, max] of the per-round ratios. The f32
matmul ceiling of the machine (``benchmarks/gpt.py``, best of a measure before and after)
is quoted with every GFLOP/s figure.

A row whose operator or argument does not exist yet is reported as an error, the other
rows still run, and the suite exits 1. Writes ``llm_ops.{json,md}`` to the results folder
(``build/bench/results/``, or ``benchmarks/results/`` under ``cannjax bench --write``: see
``benchmarks/_harness.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import interleaved_times, machine, markdown_table, write_results  # noqa: E402
from gpt import matmul_ceiling  # noqa: E402

import cannjax  # noqa: E402
from cannjax.inspect import residuals  # noqa: E402

MIB = 2**20
ROWS = ("gqa", "window", "packed", "rope", "swiglu", "lce", "llama", "jsd")
# Issue 23's targets: (comparison, bound).
TARGETS = {
    "gqa_temp": ("<=", 1 / 16),
    "window_backward_time": ("<=", 0.35),
    "packed_time": ("<=", 0.4),
    "rope_layer_time": ("<=", 0.9),
    "swiglu_residuals": ("<=", 0.6),
    "lce_temp": ("<=", 0.25),
    "llama_speedup": (">=", 1.5),
    "llama_temp": ("<=", 0.5),
    "llama_grad_rel": ("<=", 1e-5),
}
SAME_MATH_RTOL = 1e-4  # the sanity bound on gradients of the same math (float32)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shapes of every row (full: issue 23's; quick: small)."""

    T: int = 4096  # attention rows 1-3
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    cap: float = 50.0
    gqa_window: int = 1024
    window: int = 512
    rope_batch: int = 2  # row 4's layer
    rope_T: int = 2048
    mlp_n: int = 4096  # row 5
    mlp_d: int = 1024
    mlp_f: int = 2816
    ce_n: int = 4096  # rows 6 and 8
    ce_d: int = 256
    ce_v: int = 32768
    label_smoothing: float = 0.1
    z_loss: float = 1e-4
    llama_layers: int = 4  # row 7
    llama_width: int = 256
    llama_heads: int = 8
    llama_kv_heads: int = 2
    llama_T: int = 512
    llama_batch: int = 4
    llama_hidden: int = 704  # 8 D / 3 rounded up to 32, as the demo's Llama
    llama_vocab: int = 1024  # as benchmarks/gpt.py


QUICK = Sizes(
    T=512,
    heads=4,
    kv_heads=2,
    head_dim=32,
    gqa_window=128,
    window=64,
    rope_batch=1,
    rope_T=256,
    mlp_n=256,
    mlp_d=128,
    mlp_f=352,
    ce_n=256,
    ce_d=64,
    ce_v=2048,
    llama_layers=2,
    llama_width=64,
    llama_heads=4,
    llama_kv_heads=2,
    llama_T=64,
    llama_batch=2,
    llama_hidden=192,
    llama_vocab=256,
)


# ------------------------------------------------------------------------------ helpers
class NotAvailable(RuntimeError):
    """An operator or model piece of issue 23 that cannjax does not have (yet)."""


def need(module: Any, name: str) -> Any:
    """``module.name``, or a clear error saying that this row cannot run without it."""
    if not hasattr(module, name):
        raise NotAvailable(f"{module.__name__}.{name} does not exist (issue 23 adds it)")
    return getattr(module, name)


def compile_fn(f: Callable, *args: Any):
    """``jax.jit(f)`` compiled for ``args`` (timed and measured as the same program)."""
    return jax.jit(f).lower(*args).compile()


def temp(compiled) -> int:
    return int(compiled.memory_analysis().temp_size_in_bytes)


def rel_diff(a: Any, b: Any) -> float:
    """Largest ``max |a - b| / max |b|`` over the arrays of two pytrees."""
    out = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        out = max(out, float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(y))), 1e-30)))
    return out


def times(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, Any]:
    """Interleaved medians (ms) of zero-argument calls; the ratio is first / second."""
    names = list(fns)
    res = interleaved_times(list(fns.values()), repeats=repeats, warmup=2, samples=True)
    out: dict[str, Any] = {
        n: {"median_ms": 1e3 * r["median_s"], "iqr_rel": r["iqr_rel"]} for n, r in zip(names, res)
    }
    a, b = res[0], res[1]
    per_round = [x / y for x, y in zip(a["samples_s"], b["samples_s"])]
    out["ratio"] = a["median_s"] / b["median_s"]
    out["ratio_min"], out["ratio_max"] = min(per_round), max(per_round)
    out["runs"] = repeats
    return out


def line(
    what: str,
    ours: str,
    base: str,
    value: float | None,
    target: str | None = None,
    *,
    met: bool | None = None,
    shown: str | None = None,
) -> dict[str, Any]:
    """One line of the summary: a measure, both sides, its value and target (if any).

    ``target`` names a key of :data:`TARGETS` (``met`` is computed from ``value``) or is
    a description of a target whose ``met`` the caller computed.
    """
    if target in TARGETS:
        cmp, bound = TARGETS[target]
        met = value <= bound if cmp == "<=" else value >= bound
        target = f"{cmp} {bound:.4g}"
    return {
        "what": what,
        "ours": ours,
        "baseline": base,
        "value": value,
        "shown": shown if shown is not None else (f"{value:.3g}" if value is not None else "-"),
        "target": target,
        "met": met,
    }


def mib(b: int) -> str:
    return f"{b / MIB:.1f} MiB"


def ms(t: dict[str, Any], name: str) -> str:
    return f"{t[name]['median_ms']:.1f} ms (±{t[name]['iqr_rel']:.0%})"


def ratio_shown(t: dict[str, Any]) -> str:
    return f"{t['ratio']:.2f} [{t['ratio_min']:.2f}, {t['ratio_max']:.2f}]"


def same_math(a: Any, b: Any, what: str = "") -> dict[str, Any]:
    err = rel_diff(a, b)
    return line(
        f"gradient max rel difference{what} (same math)",
        "-",
        "-",
        err,
        f"<= {SAME_MATH_RTOL:g}",
        met=err <= SAME_MATH_RTOL,
        shown=f"{err:.1e}",
    )


def normal(key: int, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


# ------------------------------------------------------------------------------ attention
def qkv(s: Sizes, B: int = 1, T: int | None = None):
    T = T or s.T
    return (
        normal(0, (B, T, s.heads, s.head_dim)),
        normal(1, (B, T, s.kv_heads, s.head_dim)),
        normal(2, (B, T, s.kv_heads, s.head_dim)),
    )


def plain_attention(q, k, v, *, cap=None, window=None, allowed=None):
    """Causal grouped-query attention written out as a JAX user writes it: ``jnp.repeat``
    of k and v to the query heads, the logits, ``cap * tanh(s / cap)``, the masks,
    ``jax.nn.softmax``. ``window=(left, right)``: key ``j`` is seen from query ``t`` when
    ``t - left <= j <= t + right``; ``allowed``: a boolean ``[B, 1, T, S]`` mask."""
    B, T, N, H = q.shape
    G = N // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    if cap is not None:
        s = cap * jnp.tanh(s / cap)
    t, j = jnp.arange(T)[:, None], jnp.arange(k.shape[1])[None, :]
    keep = j <= t
    if window is not None:
        keep = keep & (j >= t - window[0]) & (j <= t + window[1])
    keep = keep[None, None]
    if allowed is not None:
        keep = keep & allowed
    s = jnp.where(keep, s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


def row_gqa(s: Sizes, repeats: int) -> dict[str, Any]:
    attention = need(cannjax.ops, "attention")
    win = (s.gqa_window, 0)
    q, k, v = qkv(s)
    losses = {
        "cannjax": lambda q, k, v: attention(
            q, k, v, causal=True, logit_cap=s.cap, window=win
        ).sum(),
        "plain": lambda q, k, v: plain_attention(q, k, v, cap=s.cap, window=win).sum(),
        "dpa": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=win, implementation="xla"
        ).sum(),
    }
    c = {n: compile_fn(jax.grad(f, (0, 1, 2)), q, k, v) for n, f in losses.items()}
    mem = {n: temp(f) for n, f in c.items()}
    t = times({n: (lambda f=c[n]: f(q, k, v)) for n in ("cannjax", "plain")}, repeats)
    r = mem["cannjax"] / mem["plain"]
    return {
        "config": f"B=1, T={s.T}, N={s.heads}, K={s.kv_heads}, H={s.head_dim}, causal, "
        f"logit_cap={s.cap:g}, window={win}, grad of out.sum() wrt q, k, v",
        "temp_bytes": mem,
        "time": t,
        "lines": [
            line("grad temp memory", mib(mem["cannjax"]), mib(mem["plain"]), r, "gqa_temp"),
            line(
                "grad temp memory vs jax.nn.dot_product_attention (window, no cap)",
                mib(mem["cannjax"]),
                mib(mem["dpa"]),
                mem["cannjax"] / mem["dpa"],
            ),
            line("grad time", ms(t, "cannjax"), ms(t, "plain"), t["ratio"], shown=ratio_shown(t)),
            same_math(c["cannjax"](q, k, v), c["plain"](q, k, v)),
        ],
    }


def row_window(s: Sizes, repeats: int) -> dict[str, Any]:
    attention = need(cannjax.ops, "attention")
    q, k, v = qkv(s)
    fns = {
        "window": lambda q, k, v: attention(q, k, v, causal=True, window=(s.window, 0)),
        "causal": lambda q, k, v: attention(q, k, v, causal=True),
    }
    g = normal(3, q.shape)
    pulls, bwd, step = {}, {}, {}
    for n, f in fns.items():
        _, pulls[n] = jax.jit(lambda q, k, v, f=f: jax.vjp(f, q, k, v))(q, k, v)
        bwd[n] = compile_fn(lambda pull, g: pull(g), pulls[n], g)
        step[n] = compile_fn(
            jax.grad(lambda q, k, v, f=f: jnp.vdot(f(q, k, v), g), (0, 1, 2)), q, k, v
        )
    tb = times({n: (lambda n=n: bwd[n](pulls[n], g)) for n in fns}, repeats)
    ts = times({n: (lambda n=n: step[n](q, k, v)) for n in fns}, repeats)
    return {
        "config": f"B=1, T={s.T}, N={s.heads}, K={s.kv_heads}, H={s.head_dim}; "
        f"window=({s.window}, 0) against causal=True, both cannjax.ops.attention",
        "backward_time": tb,
        "fwd_bwd_time": ts,
        "temp_bytes": {n: temp(f) for n, f in step.items()},
        "lines": [
            line(
                "backward time (vs full causal)",
                ms(tb, "window"),
                ms(tb, "causal"),
                tb["ratio"],
                "window_backward_time",
                shown=ratio_shown(tb),
            ),
            line(
                "forward + backward time (vs full causal)",
                ms(ts, "window"),
                ms(ts, "causal"),
                ts["ratio"],
                shown=ratio_shown(ts),
            ),
        ],
    }


def segment_lengths(T: int) -> list[int]:
    """Four unequal packed sequences filling ``T`` (not aligned to blocks)."""
    first = [round(T * f) for f in (0.366, 0.269, 0.22)]
    return [*first, T - sum(first)]


def row_packed(s: Sizes, repeats: int) -> dict[str, Any]:
    attention = need(cannjax.ops, "attention")
    q, k, v = qkv(s)
    lengths = segment_lengths(s.T)
    seg = jnp.repeat(jnp.arange(4, dtype=jnp.int32), np.array(lengths), total_repeat_length=s.T)
    seg = seg[None]  # [B, T]
    mask = (seg[:, :, None] == seg[:, None, :])[:, None]  # [B, 1, T, T], block-diagonal
    losses = {
        "segment_ids": lambda q, k, v: attention(q, k, v, causal=True, segment_ids=seg).sum(),
        "dense mask": lambda q, k, v: attention(q, k, v, causal=True, mask=mask).sum(),
    }
    c = {n: compile_fn(jax.grad(f, (0, 1, 2)), q, k, v) for n, f in losses.items()}
    t = times({n: (lambda f=c[n]: f(q, k, v)) for n in losses}, repeats)
    mem = {n: temp(f) for n, f in c.items()}
    return {
        "config": f"B=1, T={s.T}, N={s.heads}, K={s.kv_heads}, H={s.head_dim}, causal, "
        f"segments of {lengths}; grad of out.sum() wrt q, k, v",
        "time": t,
        "temp_bytes": mem,
        "lines": [
            line(
                "forward + backward time (vs dense mask)",
                ms(t, "segment_ids"),
                ms(t, "dense mask"),
                t["ratio"],
                "packed_time",
                shown=ratio_shown(t),
            ),
            line(
                "grad temp memory",
                mib(mem["segment_ids"]),
                mib(mem["dense mask"]),
                mem["segment_ids"] / mem["dense mask"],
            ),
            same_math(c["segment_ids"](q, k, v), c["dense mask"](q, k, v)),
        ],
    }


# ------------------------------------------------------------------------------ rope
def plain_rope(x, positions, theta=10000.0):
    """HF Llama's rope: ``x cos + rotate_half(x) sin``, ``x [B, T, N, H]``, positions ``[T]``."""
    H = x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H)
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([ang, ang], axis=-1)[None, :, None, :]  # [1, T, 1, H]
    x1, x2 = x[..., : H // 2], x[..., H // 2 :]
    return x * jnp.cos(emb) + jnp.concatenate([-x2, x1], axis=-1) * jnp.sin(emb)


def rope_layer(kind: str, s: Sizes) -> Callable:
    """``x -> q, k, v -> rope(q), rope(k) -> causal GQA attention -> x_out``."""
    N, K, H = s.heads, s.kv_heads, s.head_dim
    if kind == "cannjax":
        rope, attention = need(cannjax.ops, "rope"), need(cannjax.ops, "attention")

        def attend(q, k, v):
            return attention(q, k, v, causal=True)
    else:
        rope = plain_rope

        def attend(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    def layer(p, x, positions):
        B, T, _ = x.shape
        q = (x @ p["wq"]).reshape(B, T, N, H)
        k = (x @ p["wk"]).reshape(B, T, K, H)
        v = (x @ p["wv"]).reshape(B, T, K, H)
        q, k = rope(q, positions), rope(k, positions)
        return attend(q, k, v).reshape(B, T, N * H) @ p["wo"]

    return layer


def row_rope(s: Sizes, repeats: int) -> dict[str, Any]:
    rope = need(cannjax.ops, "rope")
    B, T, N, K, H = s.rope_batch, s.rope_T, s.heads, s.kv_heads, s.head_dim
    D = N * H
    positions = jnp.arange(T, dtype=jnp.int32)
    x4 = normal(0, (B, T, N, H))
    ours_res = residuals(lambda x, pos: rope(x, pos).sum(), x4, positions)
    plain_res = residuals(lambda x, pos: plain_rope(x, pos).sum(), x4, positions)
    only_positions = ours_res.count == 1 and ours_res.rows[0].shape == positions.shape
    only_positions = only_positions and ours_res.total_bytes == positions.nbytes

    p = {
        "wq": normal(1, (D, N * H), D**-0.5),
        "wk": normal(2, (D, K * H), D**-0.5),
        "wv": normal(3, (D, K * H), D**-0.5),
        "wo": normal(4, (N * H, D), D**-0.5),
    }
    x, y = normal(5, (B, T, D)), normal(6, (B, T, D))

    def step_of(kind):
        layer = rope_layer(kind, s)
        return jax.value_and_grad(
            lambda p, x: jnp.mean(jnp.square(layer(p, x, positions) - y)), (0, 1)
        )

    c = {kind: compile_fn(step_of(kind), p, x) for kind in ("cannjax", "plain")}
    t = times({n: (lambda f=c[n]: f(p, x)) for n in c}, repeats)
    mem = {n: temp(f) for n, f in c.items()}
    return {
        "config": f"rope alone: x [{B}, {T}, {N}, {H}], positions int32 [{T}]; layer: "
        f"B={B}, T={T}, D={D}, N={N}, K={K}, H={H}, value_and_grad of a squared error wrt "
        "the weights and x",
        "residuals": {
            "cannjax": [dataclasses.asdict(r) for r in ours_res.rows],
            "plain_bytes": plain_res.total_bytes,
        },
        "time": t,
        "temp_bytes": mem,
        "lines": [
            line(
                "rope residuals",
                f"{ours_res.count} arrays, {ours_res.total_bytes:,} B",
                f"{plain_res.count} arrays, {plain_res.total_bytes:,} B",
                ours_res.total_bytes / plain_res.total_bytes,
                f"positions only ({positions.nbytes:,} B)",
                met=only_positions,
            ),
            line(
                "rope + attention layer step time",
                ms(t, "cannjax"),
                ms(t, "plain"),
                t["ratio"],
                "rope_layer_time",
                shown=ratio_shown(t),
            ),
            line(
                "rope + attention layer step temp memory",
                mib(mem["cannjax"]),
                mib(mem["plain"]),
                mem["cannjax"] / mem["plain"],
            ),
            same_math(c["cannjax"](p, x), c["plain"](p, x)),
        ],
    }


# ------------------------------------------------------------------------------ swiglu
def plain_swiglu(x, w_gate, w_up, w_down):
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def row_swiglu(s: Sizes, repeats: int, ceiling: float) -> dict[str, Any]:
    swiglu = need(cannjax.ops, "swiglu")
    n, d, f = s.mlp_n, s.mlp_d, s.mlp_f
    args = (
        normal(0, (n, d)),
        normal(1, (d, f), d**-0.5),
        normal(2, (d, f), d**-0.5),
        normal(3, (f, d), f**-0.5),
    )
    cot = normal(4, (n, d))
    fns = {"cannjax": swiglu, "plain": plain_swiglu}
    res = {k: residuals(lambda *a, fn=fn: fn(*a).sum(), *args) for k, fn in fns.items()}
    c = {
        k: compile_fn(jax.grad(lambda *a, fn=fn: jnp.vdot(fn(*a), cot), (0, 1, 2, 3)), *args)
        for k, fn in fns.items()
    }
    t = times({k: (lambda f=c[k]: f(*args)) for k in c}, repeats)
    mem = {k: temp(v) for k, v in c.items()}
    flops = 3 * 2 * n * d * f * 3  # three products, forward x 3
    gflops = flops / (t["cannjax"]["median_ms"] * 1e6)
    rb = {k: r.total_bytes for k, r in res.items()}
    return {
        "config": f"x [{n}, {d}], w_gate, w_up [{d}, {f}], w_down [{f}, {d}]; residuals of "
        "out.sum(); gradient of vdot(out, c) wrt all four, c random",
        "residual_bytes": rb,
        "residual_counts": {k: r.count for k, r in res.items()},
        "time": t,
        "temp_bytes": mem,
        "gflop": flops / 1e9,
        "cannjax_gflops": gflops,
        "lines": [
            line(
                "residual bytes",
                mib(rb["cannjax"]),
                mib(rb["plain"]),
                rb["cannjax"] / rb["plain"],
                "swiglu_residuals",
            ),
            line(
                "grad time",
                f"{ms(t, 'cannjax')}, {gflops:.0f} GFLOP/s ({gflops / ceiling:.0%} of ceiling)",
                ms(t, "plain"),
                t["ratio"],
                shown=ratio_shown(t),
            ),
            line(
                "grad temp memory",
                mib(mem["cannjax"]),
                mib(mem["plain"]),
                mem["cannjax"] / mem["plain"],
            ),
            same_math(c["cannjax"](*args), c["plain"](*args)),
        ],
    }


# ------------------------------------------------------------------------------ losses
def ce_data(s: Sizes, teacher: bool = False):
    n, d, v = s.ce_n, s.ce_d, s.ce_v
    x, w = normal(0, (n, d)), normal(1, (d, v), 0.05)
    labels = jax.random.randint(jax.random.key(2), (n,), 0, v)
    if not teacher:
        return x, w, labels
    return x, w, normal(3, (n, d)), normal(4, (d, v), 0.05)


def plain_smoothed_ce(x, w, labels, label_smoothing, z_loss):
    """Per-row loss as users write it: full logits, optax's smoothing and cross-entropy,
    PaLM's z-loss ``z_loss * logsumexp(logits)**2``."""
    logits = x @ w
    targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return optax.softmax_cross_entropy(logits, targets) + z_loss * jnp.square(lse)


def row_lce(s: Sizes, repeats: int, ceiling: float) -> dict[str, Any]:
    lce = need(cannjax.ops, "linear_cross_entropy")
    x, w, labels = ce_data(s)
    kw = {"label_smoothing": s.label_smoothing, "z_loss": s.z_loss}
    losses = {
        "cannjax": lambda x, w: lce(x, w, labels, **kw).mean(),
        "plain": lambda x, w: plain_smoothed_ce(x, w, labels, **kw).mean(),
        "cannjax mean": lambda x, w: lce(x, w, labels, reduction="mean", **kw),
    }
    c = {k: compile_fn(jax.value_and_grad(f, (0, 1)), x, w) for k, f in losses.items()}
    mem = {k: temp(v) for k, v in c.items()}
    t = times({k: (lambda f=c[k]: f(x, w)) for k in ("cannjax", "plain")}, repeats)
    tm = times({k: (lambda f=c[k]: f(x, w)) for k in ("cannjax mean", "plain")}, repeats)
    flops = 3 * 2 * s.ce_n * s.ce_d * s.ce_v
    gflops = flops / (t["plain"]["median_ms"] * 1e6)
    return {
        "config": f"N={s.ce_n}, D={s.ce_d}, V={s.ce_v}, label_smoothing={s.label_smoothing}, "
        f"z_loss={s.z_loss:g}; value_and_grad of the mean loss wrt x, w",
        "temp_bytes": mem,
        "time": t,
        "time_mean": tm,
        "plain_gflops": gflops,
        "lines": [
            line(
                "value_and_grad temp memory (per-row loss, .mean())",
                mib(mem["cannjax"]),
                mib(mem["plain"]),
                mem["cannjax"] / mem["plain"],
                "lce_temp",
            ),
            line(
                "value_and_grad temp memory (reduction='mean')",
                mib(mem["cannjax mean"]),
                mib(mem["plain"]),
                mem["cannjax mean"] / mem["plain"],
                "lce_temp",
            ),
            line(
                "value_and_grad time (per-row loss, .mean())",
                ms(t, "cannjax"),
                f"{ms(t, 'plain')}, {gflops:.0f} GFLOP/s ({gflops / ceiling:.0%} of ceiling)",
                t["ratio"],
                shown=ratio_shown(t),
            ),
            line(
                "value_and_grad time (reduction='mean')",
                ms(tm, "cannjax mean"),
                ms(tm, "plain"),
                tm["ratio"],
                shown=ratio_shown(tm),
            ),
            same_math(c["cannjax"](x, w), c["plain"](x, w), " (per-row loss)"),
            same_math(c["cannjax mean"](x, w), c["plain"](x, w), " (reduction='mean')"),
        ],
    }


def plain_jsd(x, w, tx, tw, beta, temperature=1.0):
    """Generalized JSD per row, both ``[N, V]`` logits materialized: with ``p`` the
    teacher's and ``q`` the student's distribution, ``m = beta p + (1 - beta) q``,
    ``beta KL(p || m) + (1 - beta) KL(q || m)`` (Liger-Kernel's convention)."""
    log_q = jax.nn.log_softmax((x @ w) / temperature, axis=-1)
    log_p = jax.nn.log_softmax((tx @ tw) / temperature, axis=-1)
    p, q = jnp.exp(log_p), jnp.exp(log_q)
    log_m = jnp.log(beta * p + (1 - beta) * q)
    kl_p = jnp.sum(p * (log_p - log_m), axis=-1)
    kl_q = jnp.sum(q * (log_q - log_m), axis=-1)
    return beta * kl_p + (1 - beta) * kl_q


def row_jsd(s: Sizes, repeats: int) -> dict[str, Any]:
    ljsd = need(cannjax.ops, "linear_jensen_shannon")
    x, w, tx, tw = ce_data(s, teacher=True)
    beta = 0.5
    losses = {
        "cannjax": lambda x, w: ljsd(x, w, tx, tw, beta=beta, reduction="mean"),
        "plain": lambda x, w: plain_jsd(x, w, tx, tw, beta).mean(),
    }
    c = {k: compile_fn(jax.value_and_grad(f, (0, 1)), x, w) for k, f in losses.items()}
    mem = {k: temp(v) for k, v in c.items()}
    t = times({k: (lambda f=c[k]: f(x, w)) for k in c}, repeats)
    return {
        "config": f"N={s.ce_n}, D={s.ce_d} (student and teacher), V={s.ce_v}, beta={beta}; "
        "value_and_grad of the mean wrt the student's x, w",
        "temp_bytes": mem,
        "time": t,
        "lines": [
            line(
                "value_and_grad temp memory",
                mib(mem["cannjax"]),
                mib(mem["plain"]),
                mem["cannjax"] / mem["plain"],
            ),
            line(
                "value_and_grad time",
                ms(t, "cannjax"),
                ms(t, "plain"),
                t["ratio"],
                shown=ratio_shown(t),
            ),
            same_math(c["cannjax"](x, w), c["plain"](x, w)),
        ],
    }


# ------------------------------------------------------------------------------ llama
def llama_config(s: Sizes):
    config = need(cannjax.models, "LlamaConfig")
    kw = {
        "layers": s.llama_layers,
        "width": s.llama_width,
        "heads": s.llama_heads,
        "kv_heads": s.llama_kv_heads,
        "seq_len": s.llama_T,
        "hidden": s.llama_hidden,
        "vocab": s.llama_vocab,
    }
    return config(**kw)


def llama_flops(cfg, batch: int) -> float:
    """Matmul FLOPs of one training step (forward x 3), counted by hand from the config."""
    d, t, L = cfg.width, cfg.seq_len, cfg.layers
    h, hidden = d // cfg.heads, cfg.hidden
    tokens = batch * t
    proj = 2 * tokens * d * (2 * d + 2 * cfg.kv_heads * h)  # q, o; k, v
    mlp = 2 * tokens * 3 * d * hidden
    attn = 2 * 2 * batch * t * t * d
    return 3 * (L * (proj + mlp + attn) + 2 * tokens * d * cfg.vocab)


def row_llama(s: Sizes, repeats: int, ceiling: float) -> dict[str, Any]:
    init = need(cannjax.models, "init_llama")
    loss_c = need(cannjax.models, "llama_loss")
    loss_p = need(cannjax.models, "plain_llama_loss")
    cfg = llama_config(s)
    B = s.llama_batch
    params = init(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (B, cfg.seq_len), 0, cfg.vocab)
    targets = jnp.roll(tokens, -1, axis=1)
    opt = optax.adam(1e-3)
    state = opt.init(params)

    def step_of(loss_fn):
        def step(params, opt_state, tokens, targets):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets, cfg)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return step

    g = {
        k: jax.jit(jax.grad(f), static_argnums=3)(params, tokens, targets, cfg)
        for k, f in (("cannjax", loss_c), ("plain", loss_p))
    }
    grad_rel = rel_diff(g["cannjax"], g["plain"])
    args = (params, state, tokens, targets)
    c = {k: compile_fn(step_of(f), *args) for k, f in (("cannjax", loss_c), ("plain", loss_p))}
    mem = {k: temp(v) for k, v in c.items()}
    t = times({k: (lambda f=c[k]: f(*args)) for k in c}, repeats)
    speedup = 1 / t["ratio"]
    flops = llama_flops(cfg, B)
    gf = {k: flops / (t[k]["median_ms"] * 1e6) for k in c}
    return {
        "config": f"{cfg!r}, B={B}; step = value_and_grad + optax.adam, jitted",
        "temp_bytes": mem,
        "time": t,
        "gflop_per_step": flops / 1e9,
        "gflops": gf,
        "grad_max_rel_difference": grad_rel,
        "lines": [
            line(
                "step speed-up (plain / cannjax time)",
                f"{ms(t, 'cannjax')}, {gf['cannjax']:.0f} GFLOP/s "
                f"({gf['cannjax'] / ceiling:.0%} of ceiling)",
                f"{ms(t, 'plain')}, {gf['plain']:.0f} GFLOP/s",
                speedup,
                "llama_speedup",
                shown=f"{speedup:.2f}x [{1 / t['ratio_max']:.2f}, {1 / t['ratio_min']:.2f}]",
            ),
            line(
                "step temp memory",
                mib(mem["cannjax"]),
                mib(mem["plain"]),
                mem["cannjax"] / mem["plain"],
                "llama_temp",
            ),
            line(
                "gradient max rel difference",
                "-",
                "-",
                grad_rel,
                "llama_grad_rel",
                shown=f"{grad_rel:.1e}",
            ),
        ],
    }


# ------------------------------------------------------------------------------ report
TITLES = {
    "gqa": "1. GQA + soft-cap + window vs written out",
    "window": "2. sliding window vs full causal (cannjax)",
    "packed": "3. segment_ids vs dense block-diagonal mask",
    "rope": "4. rope; rope + attention layer vs rotate_half + jax.nn",
    "swiglu": "5. swiglu vs plain autodiff",
    "lce": "6. linear_cross_entropy, smoothing + z-loss, vs optax on full logits",
    "llama": "7. Llama-style model step vs its plain-JAX twin",
    "jsd": "8. linear_jensen_shannon vs both logits materialized",
}
HEAD = ["row", "measure", "cannjax", "baseline", "ratio", "target", "result"]


def verdict(met: bool | None) -> str:
    return "-" if met is None else ("met" if met else "MISSED")


def in_order(rows: dict[str, Any]) -> list[tuple[str, Any]]:
    """The rows in the order of :data:`ROWS` (a recorded JSON has its keys sorted)."""
    return sorted(rows.items(), key=lambda kv: ROWS.index(kv[0]) if kv[0] in ROWS else 99)


def summary_rows(rows: dict[str, Any]) -> list[list[str]]:
    out = []
    for name, r in in_order(rows):
        title = TITLES.get(name, name)
        if "error" in r:
            out.append([title, "error", r["error"][:200], "-", "-", "-", "ERROR"])
            continue
        for ln in r["lines"]:
            out.append(
                [
                    title,
                    ln["what"],
                    ln["ours"],
                    ln["baseline"],
                    ln["shown"],
                    ln["target"] or "-",
                    verdict(ln["met"]),
                ]
            )
            title = ""
    return out


def markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    parts = [
        "# LLM operators of issue 23 against plain JAX",
        "",
        f"Command: `{res['command']}` ({res['when']}; {m['backend']} ({m['device']}, "
        f"{m['cpu_count']} CPUs), jax {m['jax']}). Matmul ceiling "
        f"{res['matmul_ceiling_gflops']:.0f} GFLOP/s "
        "(f32 2048^3, best of a measure before and after). Ratios are cannjax / baseline "
        "(the speed-up: baseline / cannjax); times are medians of "
        f"{res['repeats']} interleaved rounds after warm-up (± IQR/median), [min, max] of "
        "the per-round ratios; memory is deterministic, times are not (a shared 2-core "
        "CPU). Targets: issue 23; a missed target reads MISSED.",
        "",
        markdown_table(HEAD, summary_rows(res["rows"])),
        "",
        "Configurations:",
        "",
    ]
    for name, r in in_order(res["rows"]):
        parts.append(f"- {TITLES.get(name, name)}: {r.get('config', '-')}")
    return "\n".join(parts) + "\n"


def run_row(name: str, s: Sizes, repeats: int, ceiling: float) -> dict[str, Any]:
    fns = {
        "gqa": lambda: row_gqa(s, repeats),
        "window": lambda: row_window(s, repeats),
        "packed": lambda: row_packed(s, repeats),
        "rope": lambda: row_rope(s, repeats),
        "swiglu": lambda: row_swiglu(s, repeats, ceiling),
        "lce": lambda: row_lce(s, repeats, ceiling),
        "llama": lambda: row_llama(s, repeats, ceiling),
        "jsd": lambda: row_jsd(s, repeats),
    }
    try:
        return fns[name]()
    except Exception as e:  # reported as the row's result; the other rows still run
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"}


# docs/llm_ops.md holds the recorded table between these markers (``--docs`` rewrites it).
DOCS = Path(__file__).resolve().parents[1] / "docs" / "llm_ops.md"
START, END = "<!-- llm_ops table: start -->", "<!-- llm_ops table: end -->"


def update_docs(res: dict[str, Any], docs: Path = DOCS) -> None:
    """Replaces the table of ``docs`` with the one of a full run's results ``res``."""
    if res.get("quick") or set(res["rows"]) != set(ROWS):
        raise SystemExit(
            "llm_ops: --docs records a full run of every row only (this one is "
            + ("--quick" if res.get("quick") else f"of the rows {list(res['rows'])}")
            + "); its figures would say nothing about the targets"
        )
    text = docs.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    table = markdown(res).split("\n", 2)[2]  # without the title line
    docs.write_text(f"{head}{START}\n{table.strip()}\n{END}{tail}")
    print(f"wrote the table of {docs}")


def main(argv=None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, 3 timed rounds")
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), help="rows to run")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (10; --quick 3)")
    p.add_argument(
        "--table",
        type=Path,
        default=None,
        help="measure nothing: print the markdown of a recorded llm_ops.json",
    )
    p.add_argument(
        "--docs",
        action="store_true",
        help="also replace the table of docs/llm_ops.md (full runs of every row only); "
        "with --table, from that file",
    )
    a = p.parse_args(argv)
    if a.table is not None:
        res = json.loads(a.table.read_text())
        print(markdown(res))
        if a.docs:
            update_docs(res)
        return res
    repeats = a.repeats or (3 if a.quick else 10)
    if not a.quick and repeats < 10:
        p.error(f"--repeats must be >= 10 for a full run (medians of >= 10), got {repeats}")
    if a.docs and (a.quick or set(a.rows) != set(ROWS)):
        p.error("--docs records a full run of every row: drop --quick and --rows")
    s = QUICK if a.quick else Sizes()
    ceiling = matmul_ceiling()
    print(f"matmul ceiling {ceiling:.0f} GFLOP/s", flush=True)
    rows = {}
    for name in [r for r in ROWS if r in a.rows]:
        t0 = time.perf_counter()
        rows[name] = run_row(name, s, repeats, ceiling)
        print(markdown_table(HEAD, summary_rows({name: rows[name]})), flush=True)
        print(f"({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
    ceiling = max(ceiling, matmul_ceiling())
    command = "PYTHONPATH=. python benchmarks/llm_ops.py" + " --quick" * a.quick
    if list(rows) != list(ROWS):
        command += " --rows " + " ".join(rows)
    res = {
        "command": command,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "quick": a.quick,
        "repeats": repeats,
        "sizes": dataclasses.asdict(s),
        "targets": {k: list(v) for k, v in TARGETS.items()},
        "matmul_ceiling_gflops": ceiling,
        "rows": rows,
    }
    md = markdown(res)
    write_results("llm_ops", res, md)
    print(md)
    failed = [n for n, r in rows.items() if "error" in r]
    if failed:
        print(f"llm_ops: {len(failed)} row(s) could not run: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)
    if a.docs:
        update_docs(res)
    return res


if __name__ == "__main__":
    main()
