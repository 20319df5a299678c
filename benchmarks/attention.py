"""Memory and time of cannjax.ops.attention and linear_cross_entropy against plain JAX.

Baseline: ``jax.nn.dot_product_attention(..., implementation="xla")`` differentiated by
plain JAX; ``optax.softmax_cross_entropy_with_integer_labels(x @ w, labels)``. Memory
figures come from ``compiled.memory_analysis()`` (temp bytes, deterministic) and from
the saved residuals; times are fwd+bwd (grad / value_and_grad) medians of interleaved
A B A B runs after warm-up, reported as ratios ours / plain with the spread.

Run: ``PYTHONPATH=. python benchmarks/attention.py [--quick]``. Writes
``attention.{json,md,png}``
to the results folder (``build/bench/results/``, or ``benchmarks/results/`` under
``cannjax bench --write``: see ``benchmarks/_harness.py``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _harness import RESULTS, paired_ratio  # noqa: E402

from cannjax.inspect import compiled_memory, residuals  # noqa: E402
from cannjax.ops import attention, linear_cross_entropy  # noqa: E402

MIB = 2**20


# ------------------------------------------------------------------------------ helpers
def _qkv(T, N=8, H=64):
    ks = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(k, (1, T, N, H), jnp.float32) for k in ks]


def _attn_loss(impl, **kw):
    if impl == "ours":
        return lambda q, k, v: attention(q, k, v, causal=True, **kw).sum()
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="xla"
    ).sum()


def _lce_data(N, D, V):
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (N, D), jnp.float32)
    w = jax.random.normal(ks[1], (D, V), jnp.float32) * 0.05
    labels = jax.random.randint(ks[2], (N,), 0, V)
    return x, w, labels


def _lce_loss(impl, labels, **kw):
    if impl == "ours":
        return lambda x, w: linear_cross_entropy(x, w, labels, **kw).mean()
    if impl == "ours, reduction='mean'":
        return lambda x, w: linear_cross_entropy(x, w, labels, reduction="mean", **kw)
    return lambda x, w: optax.softmax_cross_entropy_with_integer_labels(x @ w, labels).mean()


def _temp(f, *args):
    return compiled_memory(f, *args).temp_bytes


# ------------------------------------------------------------------------------ suites
def attention_suite(quick):
    out = {"config": "B=1, N=8, H=64, causal, float32, grad wrt q, k, v"}
    q, k, v = _qkv(1024)
    ro = residuals(_attn_loss("ours"), q, k, v).total_bytes
    rp = residuals(_attn_loss("plain"), q, k, v).total_bytes
    out["residuals_T1024"] = {"ours_bytes": ro, "plain_bytes": rp, "ratio": ro / rp}
    print(f"attention residuals T=1024: ours {ro / MIB:.2f} MiB, plain {rp / MIB:.2f} MiB")
    lengths = [512, 1024, 2048, 4096, 8192]
    timed = {512: 10, 1024: 10, 2048: 5, 4096: 3} if not quick else {1024: 10, 4096: 3}
    rows = []
    for T in lengths:
        q, k, v = _qkv(T)
        go = jax.grad(_attn_loss("ours"), (0, 1, 2))
        gp = jax.grad(_attn_loss("plain"), (0, 1, 2))
        row = {
            "T": T,
            "ours_temp_bytes": _temp(go, q, k, v),
            "plain_temp_bytes": _temp(gp, q, k, v),
        }
        row["temp_ratio"] = row["ours_temp_bytes"] / row["plain_temp_bytes"]
        if T in timed:
            row["time"] = paired_ratio(jax.jit(go), jax.jit(gp), (q, k, v), timed[T])
        rows.append(row)
        msg = f"attention T={T}: temp ours {row['ours_temp_bytes'] / MIB:.1f} MiB, plain "
        msg += f"{row['plain_temp_bytes'] / MIB:.1f} MiB (x{row['temp_ratio']:.3f})"
        if "time" in row:
            t = row["time"]
            msg += f"; time {t['ours_ms']:.0f} vs {t['plain_ms']:.0f} ms, ratio {t['ratio']:.2f}"
            msg += f" [{t['ratio_min']:.2f}, {t['ratio_max']:.2f}]"
        print(msg, flush=True)
    out["by_length"] = rows
    return out


def block_suite(quick):
    """fwd+bwd time of a few (block_q, block_k) at T=1024 against the default."""
    q, k, v = _qkv(1024)
    base = jax.jit(jax.grad(_attn_loss("ours"), (0, 1, 2)))
    rows = []
    for bq, bk in [(64, 64), (64, 128), (128, 256), (256, 256), (256, 512)]:
        f = jax.jit(jax.grad(_attn_loss("ours", block_q=bq, block_k=bk), (0, 1, 2)))
        t = paired_ratio(f, base, (q, k, v), 3 if quick else 6)
        rows.append({"block_q": bq, "block_k": bk, "vs_default": t["ratio"], **t})
        print(f"blocks {bq}x{bk}: {t['ours_ms']:.0f} ms, x{t['ratio']:.2f} of 128x128", flush=True)
    return rows


def lce_suite(quick):
    out = {"config": "N=4096, D=256, float32, value_and_grad of the mean loss wrt x, w"}
    N, D = 4096, 256
    rows = []
    for V in [4096, 8192, 16384, 32768, 65536]:
        x, w, labels = _lce_data(N, D, V)
        vo = jax.value_and_grad(_lce_loss("ours", labels), (0, 1))
        vp = jax.value_and_grad(_lce_loss("plain", labels), (0, 1))
        vr = jax.value_and_grad(_lce_loss("ours, reduction='mean'", labels), (0, 1))
        row = {"V": V, "ours_temp_bytes": _temp(vo, x, w), "plain_temp_bytes": _temp(vp, x, w)}
        row["temp_ratio"] = row["ours_temp_bytes"] / row["plain_temp_bytes"]
        row["mean_temp_bytes"] = _temp(vr, x, w)
        if V == 32768 or (not quick and V <= 16384):
            row["time"] = paired_ratio(jax.jit(vo), jax.jit(vp), (x, w), 3 if quick else 5)
            row["mean_time"] = paired_ratio(jax.jit(vr), jax.jit(vp), (x, w), 3 if quick else 5)
        rows.append(row)
        msg = f"linear_cross_entropy V={V}: temp ours {row['ours_temp_bytes'] / MIB:.1f} MiB, "
        msg += f"plain {row['plain_temp_bytes'] / MIB:.1f} MiB (x{row['temp_ratio']:.3f})"
        if "time" in row:
            t = row["time"]
            msg += f"; time {t['ours_ms']:.0f} vs {t['plain_ms']:.0f} ms, ratio {t['ratio']:.2f}"
            msg += f" [{t['ratio_min']:.2f}, {t['ratio_max']:.2f}]"
            t = row["mean_time"]
            msg += f"; reduction='mean' {t['ours_ms']:.0f} ms, ratio {t['ratio']:.2f}"
        print(msg, flush=True)
    out["by_vocab"] = rows
    return out


# ------------------------------------------------------------------------------ output
def _markdown(res):
    a, c = res["attention"], res["linear_cross_entropy"]
    r = a["residuals_T1024"]
    lines = [
        "# attention and linear_cross_entropy against plain JAX",
        "",
        f"Command: `{res['command']}` ({res['when']}, {res['machine']}). Ratios are "
        "ours / plain; times are medians of interleaved runs on a shared 2-core CPU, "
        "[min, max] of the per-pair ratios.",
        "",
        f"## attention ({a['config']})",
        "",
        f"Residuals at T=1024: ours {r['ours_bytes'] / MIB:.2f} MiB, plain "
        f"{r['plain_bytes'] / MIB:.2f} MiB (x{r['ratio']:.3f}).",
        "",
        "| T | temp ours (MiB) | temp plain (MiB) | temp ratio | fwd+bwd ours (ms) "
        "| plain (ms) | time ratio [min, max] |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in a["by_length"]:
        t = row.get("time")
        tcol = (
            f"{t['ours_ms']:.0f} | {t['plain_ms']:.0f} | {t['ratio']:.2f} "
            f"[{t['ratio_min']:.2f}, {t['ratio_max']:.2f}] ({t['runs']} runs)"
            if t
            else "- | - | not timed"
        )
        lines.append(
            f"| {row['T']} | {row['ours_temp_bytes'] / MIB:.1f} | "
            f"{row['plain_temp_bytes'] / MIB:.1f} | {row['temp_ratio']:.3f} | {tcol} |"
        )
    if res.get("blocks"):
        lines += ["", "Block sizes at T=1024 (time relative to the CPU default 128 x 128):", ""]
        lines += ["| block_q x block_k | ms | ratio [min, max] |", "|---|---|---|"]
        for b in res["blocks"]:
            lines.append(
                f"| {b['block_q']} x {b['block_k']} | {b['ours_ms']:.0f} | {b['vs_default']:.2f} "
                f"[{b['ratio_min']:.2f}, {b['ratio_max']:.2f}] |"
            )
    lines += [
        "",
        f"## linear_cross_entropy ({c['config']})",
        "",
        "`ours` is the per-row loss then `.mean()` (4 products: the backward recomputes "
        "the logits); `mean` is `reduction='mean'` (3 products: the gradients are made in "
        "the forward). Both ratios are against plain JAX in their own interleaved pair.",
        "",
        "| V | temp ours (MiB) | temp mean (MiB) | temp plain (MiB) | temp ratio ours | "
        "ours (ms) | plain (ms) | time ratio [min, max] | mean (ms) | mean time ratio "
        "[min, max] |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in c["by_vocab"]:
        t, tm = row.get("time"), row.get("mean_time")
        tcol = (
            f"{t['ours_ms']:.0f} | {t['plain_ms']:.0f} | {t['ratio']:.2f} "
            f"[{t['ratio_min']:.2f}, {t['ratio_max']:.2f}] ({t['runs']} runs) | "
            f"{tm['ours_ms']:.0f} | {tm['ratio']:.2f} [{tm['ratio_min']:.2f}, "
            f"{tm['ratio_max']:.2f}]"
            if t and tm
            else "- | - | not timed | - | -"
        )
        mean_temp = row.get("mean_temp_bytes")
        mean_col = f"{mean_temp / MIB:.1f}" if mean_temp is not None else "-"
        lines.append(
            f"| {row['V']} | {row['ours_temp_bytes'] / MIB:.1f} | {mean_col} | "
            f"{row['plain_temp_bytes'] / MIB:.1f} | {row['temp_ratio']:.3f} | {tcol} |"
        )
    return "\n".join(lines) + "\n"


def _plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(10, 3), dpi=80)
    a = res["attention"]["by_length"]
    Ts = [r["T"] for r in a]
    axes[0].loglog(Ts, [r["ours_temp_bytes"] / MIB for r in a], "o-", label="cannjax")
    axes[0].loglog(Ts, [r["plain_temp_bytes"] / MIB for r in a], "s--", label="plain JAX")
    axes[0].set(title="attention grad: temp memory", xlabel="T", ylabel="MiB")
    timed = [r for r in a if "time" in r]
    axes[1].loglog([r["T"] for r in timed], [r["time"]["ours_ms"] for r in timed], "o-")
    axes[1].loglog([r["T"] for r in timed], [r["time"]["plain_ms"] for r in timed], "s--")
    axes[1].set(title="attention fwd+bwd time", xlabel="T", ylabel="ms")
    c = res["linear_cross_entropy"]["by_vocab"]
    Vs = [r["V"] for r in c]
    axes[2].loglog(Vs, [r["ours_temp_bytes"] / MIB for r in c], "o-")
    axes[2].loglog(Vs, [r["plain_temp_bytes"] / MIB for r in c], "s--")
    axes[2].set(title="linear CE value_and_grad: temp", xlabel="V (N=4096, D=256)", ylabel="MiB")
    axes[0].legend(fontsize=8)
    for ax in axes:
        ax.tick_params(labelsize=7)
        ax.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None):
    """Runs the suites and writes the JSON, markdown and PNG results."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes and runs")
    p.add_argument("--blocks", action="store_true", help="also time a few block sizes")
    args = p.parse_args(argv)
    cmd = "PYTHONPATH=. python benchmarks/attention.py" + " --quick" * args.quick
    cmd += " --blocks" * args.blocks
    res = {
        "command": cmd,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{jax.default_backend()} ({platform.machine()}), jax {jax.__version__}",
        "attention": attention_suite(args.quick),
        "linear_cross_entropy": lce_suite(args.quick),
    }
    if args.blocks:
        res["blocks"] = block_suite(args.quick)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "attention.json").write_text(json.dumps(res, indent=1, default=float) + "\n")
    (RESULTS / "attention.md").write_text(_markdown(res))
    _plot(res, RESULTS / "attention.png")
    print(f"wrote {RESULTS}/attention.{{json,md,png}}")
    return res


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
