"""cannjax.fuse against plain JAX: residual counts, compiled memory and time of gradients.

Run: ``PYTHONPATH=. python benchmarks/fuse.py [--quick]`` (``--quick``: 4 layers, batch 64,
width 256).

1. Residuals that reverse mode keeps for ``sum(f(x))`` (``cannjax.inspect.residuals``),
   for ``f`` = ``sin(exp(x))``, a 5-op chain, ``jax.nn.gelu``, ``jax.nn.silu``.
2. A 16-layer network ``x = act(x @ W)`` (batch 256, width 1024, float32), loss
   ``mean(x**2)``, gradient with respect to the stacked weights, layers written two ways:
   under ``lax.scan`` over stacked weights, and as an unrolled Python loop. For each
   activation, plain JAX and ``cannjax.fuse`` at both levels: compiled temp memory of
   ``jax.jit(jax.grad(loss))`` and time (interleaved, median; spread = IQR / median).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from _harness import interleaved_times, markdown_table, temp_bytes, write_results  # noqa: E402

import cannjax  # noqa: E402
from cannjax.inspect import residuals  # noqa: E402

MIB = 2**20


def chain5(h):
    """The 5-op elementwise chain: sin, cos, exp, mul, tanh."""
    return jnp.tanh(jnp.sin(h) * jnp.exp(jnp.cos(h)))


ACTS = {"chain5": chain5, "gelu": jax.nn.gelu, "silu": jax.nn.silu}
CHAINS = {"sin(exp(x))": lambda x: jnp.sin(jnp.exp(x)), **ACTS}


def scan_net(act):
    def loss(x, ws):
        y, _ = lax.scan(lambda c, w: (act(c @ w), None), x, ws)
        return jnp.mean(y * y)

    return loss


def loop_net(act):
    def loss(x, ws):  # ws: a list of (width, width) weights
        for w in ws:
            x = act(x @ w)
        return jnp.mean(x * x)

    return loss


def variants(loss):
    return {
        "plain": loss,
        "fuse": cannjax.fuse(loss),
        "fuse_recompute": cannjax.fuse(loss, level="recompute"),
    }


def residual_rows():
    x = jnp.linspace(-2.0, 2.0, 256 * 1024, dtype=jnp.float32).reshape(256, 1024)
    rows, out = [], {}
    for name, f in CHAINS.items():
        loss = lambda x, f=f: f(x).sum()  # noqa: E731
        counts = {}
        for v, g in variants(loss).items():
            rep = residuals(g, x)
            full = sum(r.shape == x.shape for r in rep.rows)
            counts[v] = {"count": rep.count, "full_size": full, "bytes": rep.total_bytes}
        out[name] = counts
        rows.append(
            [name]
            + [f"{counts[v]['full_size']} ({counts[v]['bytes'] / MIB:.0f} MiB)" for v in counts]
        )
    return out, rows


def network_rows(forms, acts, layers, batch, width, repeats):
    key1, key2 = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key1, (batch, width), jnp.float32)
    ws = jax.random.normal(key2, (layers, width, width), jnp.float32) / np.sqrt(width)
    rows, out = [], {}
    for form in forms:
        for act in acts:
            make = scan_net if form == "scan" else loop_net
            vs = variants(make(ACTS[act]))
            w_arg = ws if form == "scan" else list(ws)
            grads = {v: jax.jit(jax.grad(f, argnums=1)) for v, f in vs.items()}
            mem = {v: temp_bytes(jax.grad(f, argnums=1), x, w_arg) for v, f in vs.items()}
            kept = {v: residuals(f, x, w_arg).total_bytes for v, f in vs.items()}
            ref = jnp.stack(grads["plain"](x, w_arg))
            err = {
                v: float(jnp.max(jnp.abs(jnp.stack(g(x, w_arg)) - ref)) / jnp.max(jnp.abs(ref)))
                for v, g in grads.items()
            }
            times = dict(
                zip(
                    grads,
                    interleaved_times(
                        [lambda g=g, w=w_arg: g(x, w) for g in grads.values()], repeats=repeats
                    ),
                )
            )
            key = f"{form}/{act}"
            out[key] = {
                v: {
                    "temp_mib": mem[v] / MIB,
                    "temp_ratio": mem[v] / mem["plain"],
                    "residual_mib": kept[v] / MIB,
                    "time_ms": times[v]["median_s"] * 1e3,
                    "time_ratio": times[v]["median_s"] / times["plain"]["median_s"],
                    "time_iqr_rel": times[v]["iqr_rel"],
                    "grad_rel_err": err[v],
                }
                for v in grads
            }
            r = out[key]
            rows.append(
                [
                    form,
                    act,
                    f"{r['plain']['residual_mib']:.0f} / {r['fuse']['residual_mib']:.0f}",
                    f"{r['plain']['temp_mib']:.1f}",
                    f"{r['fuse']['temp_mib']:.1f} ({r['fuse']['temp_ratio']:.2f}x)",
                    f"{r['fuse_recompute']['temp_mib']:.1f} "
                    f"({r['fuse_recompute']['temp_ratio']:.2f}x)",
                    f"{r['plain']['time_ms']:.0f} ±{r['plain']['time_iqr_rel']:.0%}",
                    f"{r['fuse']['time_ratio']:.2f}x ±{r['fuse']['time_iqr_rel']:.0%}",
                    f"{r['fuse_recompute']['time_ratio']:.2f}x "
                    f"±{r['fuse_recompute']['time_iqr_rel']:.0%}",
                ]
            )
            print(" | ".join(rows[-1]), flush=True)
    return out, rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small network, few repeats")
    p.add_argument("--repeats", type=int, default=None)
    a = p.parse_args(argv)
    repeats = a.repeats or (3 if a.quick else 10)
    layers, batch, width = (4, 64, 256) if a.quick else (16, 256, 1024)
    res, res_rows = residual_rows()
    print(markdown_table(["f", "plain", "fuse", "fuse recompute"], res_rows), flush=True)
    net, net_rows = network_rows(("scan", "loop"), tuple(ACTS), layers, batch, width, repeats)
    command = "PYTHONPATH=. python benchmarks/fuse.py" + (" --quick" if a.quick else "")
    table = "\n\n".join(
        [
            f"# cannjax.fuse\n\nCommand: `{command}` (repeats={repeats}; "
            "times are medians of interleaved runs, ± IQR/median; shared 2-core CPU).",
            "## Full-size residuals of `grad(sum(f(x)))`, x: 256 x 1024 float32\n\n"
            + markdown_table(["f", "plain", "fuse", "fuse recompute"], res_rows),
            f"## Gradient of a {layers}-layer `x = act(x @ W)` network (batch {batch}, "
            f"width {width}), with respect to the stacked weights\n\n"
            "Residuals: what JAX's backward keeps (`cannjax.inspect.residuals`, arguments "
            "included). Compiled temp memory of `jit(grad)` (MiB; ratio to plain) and time "
            "(plain in ms; ratios). `scan`: layers under `lax.scan` over stacked weights; "
            "`loop`: an unrolled Python loop over a list of weights, where XLA already "
            "recomputes the cheap elementwise residuals itself.\n\n"
            + markdown_table(
                [
                    "form",
                    "act",
                    "residuals plain / fuse MiB",
                    "plain MiB",
                    "fuse MiB",
                    "fuse recompute MiB",
                    "plain ms",
                    "fuse time",
                    "fuse recompute time",
                ],
                net_rows,
            ),
        ]
    )
    payload = {
        "command": command,
        "repeats": repeats,
        "network": {"layers": layers, "batch": batch, "width": width, "dtype": "float32"},
        "residuals": res,
        "results": net,
    }
    write_results("fuse", payload, table)
    print(table)


if __name__ == "__main__":
    main()
