"""Fine-tuning: fused preference losses and LoRA against their plain forms.

Run: ``PYTHONPATH=. python benchmarks/fine_tuning.py [--quick | --smoke]``

Preference losses: ``cannjax.ops.linear_preference_loss`` of each kind (DPO, ORPO,
SimPO, CPO, KTO) against the same loss written plainly, as TRL computes it: the full
``[2B, T, V]`` logits ``x @ w``, ``jax.nn.log_softmax``, ``jnp.take_along_axis`` and the
per-sequence sums (``linear_preference_loss``'s registered reference). Both are
``jax.value_and_grad`` with respect to the hidden states and the head, at B=4 pairs,
T=512 tokens (the first 64 of each sequence a prompt: ignored), D=256, V=32768, float32.
Gradients are compared with each other and with the plain form in float64.

LoRA: one training step of the Llama model of ``cannjax.models`` with rank-16 adapters
on every projection and the base frozen, ``value_and_grad`` with respect to the adapters
plus an Adam update: ``cannjax.models.llama_loss(..., lora=...)`` (``ops.lora_linear``)
against the same model written plainly (``x @ w + s (x @ a) @ b``, the form of flax.nnx's
``LoRALinear``). Adapter gradients are compared first.

Times are medians of interleaved runs after warm-up, as ratios ours / plain with the
spread of the per-round ratios; memory is the compiled temp size
(``compiled.memory_analysis()``). The machine's f32 and bf16 matmul ceilings are
measured and reported beside the figures. ``--smoke``: tiny sizes, one round (seconds;
its figures mean nothing). Writes ``fine_tuning.{json,md}`` to the results folder
(``benchmarks/_harness.py``).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _harness import markdown_table, paired_ratio, write_results  # noqa: E402
from gpt import matmul_ceilings  # noqa: E402

import cannjax  # noqa: E402
from cannjax.core import registry  # noqa: E402
from cannjax.ops import linear_preference_loss  # noqa: E402

MIB = 2**20
KINDS = ("dpo", "orpo", "simpo", "cpo", "kto")
SIZES = {
    "full": dict(B=4, T=512, D=256, V=32768, prompt=64),
    "smoke": dict(B=2, T=16, D=8, V=64, prompt=4),
}


def _temp(f, *args):
    return int(f.lower(*args).compile().memory_analysis().temp_size_in_bytes)


def _rel(got, want):
    """Largest |got - want| over largest |want|, over the leaves."""
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want))
    return max(
        float(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)).max())
        / float(np.abs(np.asarray(w, np.float64)).max())
        for g, w in pairs
    )


# ------------------------------------------------------------------------- preference
def preference_data(B, T, D, V, prompt, key=0):
    ks = jax.random.split(jax.random.key(key), 6)
    xc, xr = jax.random.normal(ks[0], (B, T, D)), jax.random.normal(ks[1], (B, T, D))
    w = 0.05 * jax.random.normal(ks[2], (D, V))
    y = jax.random.randint(ks[3], (2, B, T), 0, V)
    is_prompt = jnp.arange(T) < prompt
    yc, yr = jnp.where(is_prompt, -100, y[0]), jnp.where(is_prompt, -100, y[1])
    # The reference model's log-likelihoods: the policy's own, moved by about one nat, as
    # early in fine-tuning; every kind's loss is then in its working range.
    _, m = linear_preference_loss(xc, xr, w, yc, yr, kind="cpo")
    ref = jnp.stack([m.chosen_logps, m.rejected_logps]) + jax.random.normal(ks[4], (2, B))
    return (xc, xr, w), (yc, yr, ref[0], ref[1])


def preference_suite(size, runs):
    s = SIZES[size]
    (xc, xr, w), (yc, yr, rc, rr) = preference_data(**s)
    plain_fn = registry()["linear_preference_loss"].reference
    out = {"config": f"B={s['B']}, T={s['T']} ({s['prompt']} prompt), D={s['D']}, V={s['V']}, "
                     "float32, value_and_grad wrt x_chosen, x_rejected, w"}  # fmt: skip
    rows = []
    for kind in KINDS:
        refs = (rc, rr) if kind in ("dpo", "kto") else ()

        def loss_of(f, kind=kind, refs=refs):
            return lambda xc, xr, w: f(xc, xr, w, yc, yr, *refs, kind=kind)[0]

        ours = jax.jit(jax.value_and_grad(loss_of(linear_preference_loss), (0, 1, 2)))
        plain = jax.jit(jax.value_and_grad(loss_of(plain_fn), (0, 1, 2)))
        row = {"kind": kind, "ours_temp_bytes": _temp(ours, xc, xr, w)}
        row["plain_temp_bytes"] = _temp(plain, xc, xr, w)
        row["temp_ratio"] = row["ours_temp_bytes"] / row["plain_temp_bytes"]
        (lo, go), (lp, gp) = ours(xc, xr, w), plain(xc, xr, w)
        row["loss"] = [float(lo), float(lp)]
        row["grad_rel_diff"] = _rel(go, gp)
        with jax.enable_x64(True):
            wide = lambda v: v.astype(jnp.float64)  # noqa: E731
            exact_loss = loss_of(plain_fn, kind, tuple(map(wide, refs)))
            exact = jax.jit(jax.grad(exact_loss, (0, 1, 2)))(wide(xc), wide(xr), wide(w))
            row["ours_vs_float64"] = _rel(go, exact)
            row["plain_vs_float64"] = _rel(gp, exact)
        row["time"] = paired_ratio(ours, plain, (xc, xr, w), runs)
        t = row["time"]
        print(f"{kind}: temp {row['ours_temp_bytes'] / MIB:.0f} vs "
              f"{row['plain_temp_bytes'] / MIB:.0f} MiB (x{row['temp_ratio']:.3f}); time "
              f"{t['ours_ms']:.0f} vs {t['plain_ms']:.0f} ms (x{t['ratio']:.2f}); grads "
              f"{row['grad_rel_diff']:.1e} apart, vs float64 {row['ours_vs_float64']:.1e} "
              f"(plain {row['plain_vs_float64']:.1e})", flush=True)  # fmt: skip
        rows.append(row)
    out["by_kind"] = rows
    return out


def preference_table(res):
    rows = []
    for r in res["by_kind"]:
        t = r["time"]
        rows.append([
            r["kind"], f"{r['ours_temp_bytes'] / MIB:.0f}", f"{r['plain_temp_bytes'] / MIB:.0f}",
            f"{r['temp_ratio']:.3f}", f"{t['ours_ms']:.0f}", f"{t['plain_ms']:.0f}",
            f"{t['ratio']:.2f} [{t['ratio_min']:.2f}, {t['ratio_max']:.2f}]",
            f"{r['grad_rel_diff']:.1e}",
            f"{r['ours_vs_float64']:.1e} / {r['plain_vs_float64']:.1e}",
        ])  # fmt: skip
    head = ["kind", "temp MiB", "plain temp MiB", "temp ratio", "ms", "plain ms",
            "time ratio [min, max]", "grads apart (rel)", "vs float64: ours / plain"]  # fmt: skip
    return markdown_table(head, rows)


# ------------------------------------------------------------------------------- LoRA
LLAMA = {
    "full": (cannjax.models.LlamaConfig(vocab=1024, width=256, heads=8, kv_heads=2, layers=4,
                                         seq_len=512, hidden=704), 4),
    "smoke": (cannjax.models.LlamaConfig(vocab=64, width=32, heads=4, kv_heads=2, layers=1,
                                          seq_len=16, hidden=64), 2),
}  # fmt: skip
RANK, SCALE = 16, 2.0  # LoRA's alpha / r = 32 / 16


def _lora_step(loss_fn, params, cfg, opt):
    """One LoRA training step: value_and_grad w.r.t. the adapters, the base frozen (closed
    over, as flax.nnx's filtered grad over ``nnx.LoRAParam`` leaves it), then Adam."""

    def step(lora, opt_state, tokens):
        loss, grads = jax.value_and_grad(
            lambda lora: loss_fn(params, tokens, tokens, cfg, lora=lora, lora_scale=SCALE)
        )(lora)
        updates, opt_state = opt.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state, loss

    return jax.jit(step)


def lora_suite(size, runs):
    cfg, batch = LLAMA[size]
    rank = RANK if size == "full" else 4
    params = cannjax.models.init_llama(jax.random.key(0), cfg)
    # b != 0, as after some steps (at b = 0 the gradient of a is 0)
    lora = cannjax.models.init_llama_lora(jax.random.key(1), cfg, rank, b_std=0.02)
    tokens = jax.random.randint(jax.random.key(2), (batch, cfg.seq_len), 0, cfg.vocab)
    out = {"config": f"Llama L={cfg.layers}, D={cfg.width}, N={cfg.heads}, K={cfg.kv_heads}, "
                     f"F={cfg.hidden}, T={cfg.seq_len}, B={batch}, V={cfg.vocab}, rank {rank} on "
                     "every projection (scale 2), float32, value_and_grad w.r.t. the adapters + "
                     "Adam"}  # fmt: skip
    grads = [
        jax.grad(lambda lora, f=f: f(params, tokens, tokens, cfg, lora=lora, lora_scale=SCALE))(
            lora
        )
        for f in (cannjax.models.llama_loss, cannjax.models.plain_llama_loss)
    ]
    out["adapter_grad_rel_diff"] = _rel(*grads)
    opt = optax.adam(1e-3)
    state = opt.init(lora)
    ours = _lora_step(cannjax.models.llama_loss, params, cfg, opt)
    plain = _lora_step(cannjax.models.plain_llama_loss, params, cfg, opt)
    out["ours_temp_bytes"] = _temp(ours, lora, state, tokens)
    out["plain_temp_bytes"] = _temp(plain, lora, state, tokens)
    out["temp_ratio"] = out["ours_temp_bytes"] / out["plain_temp_bytes"]
    out["time"] = paired_ratio(ours, plain, (lora, state, tokens), runs)
    # One projection alone, [B T, D] x [D, F] with its adapters: what ops.lora_linear
    # changes by itself (the step's ratio includes the model's other operators).
    x = jax.random.normal(jax.random.key(3), (batch * cfg.seq_len, cfg.width))
    w = 0.02 * jax.random.normal(jax.random.key(4), (cfg.width, cfg.hidden))
    a, b = lora.w_up[0][0], lora.w_up[1][0]
    cot = jax.random.normal(jax.random.key(5), (batch * cfg.seq_len, cfg.hidden))

    def layer(f):
        # w and the cotangent are arguments: closed over, XLA would fold their products
        # into constants at compile time.
        def loss(x, a, b, w, cot):
            return jnp.vdot(f(x, w, a, b), cot)

        return jax.jit(jax.grad(loss, (0, 1, 2)))

    lo = layer(lambda x, w, a, b: cannjax.ops.lora_linear(x, w, a, b, scale=SCALE))
    lp = layer(lambda x, w, a, b: x @ w + SCALE * (x @ a @ b))
    args = (x, a, b, w, cot)
    out["layer"] = {
        "shape": f"x [{batch * cfg.seq_len}, {cfg.width}], w [{cfg.width}, {cfg.hidden}], r={rank}",
        "grad_rel_diff": _rel(lo(*args), lp(*args)),
        "ours_temp_bytes": _temp(lo, *args),
        "plain_temp_bytes": _temp(lp, *args),
        "time": paired_ratio(lo, lp, args, max(runs, 3) * 3),
    }
    t, lt = out["time"], out["layer"]["time"]
    print(f"LoRA Llama step: temp {out['ours_temp_bytes'] / MIB:.0f} vs "
          f"{out['plain_temp_bytes'] / MIB:.0f} MiB (x{out['temp_ratio']:.3f}); time "
          f"{t['ours_ms']:.0f} vs {t['plain_ms']:.0f} ms (x{t['ratio']:.2f}); adapter grads "
          f"{out['adapter_grad_rel_diff']:.1e} apart; one projection x{lt['ratio']:.2f}",
          flush=True)  # fmt: skip
    return out


def lora_table(res):
    t, layer = res["time"], res["layer"]
    lt = layer["time"]
    rows = [
        ["Llama LoRA step", f"{res['ours_temp_bytes'] / MIB:.1f}",
         f"{res['plain_temp_bytes'] / MIB:.1f}", f"{res['temp_ratio']:.3f}",
         f"{t['ours_ms']:.1f}", f"{t['plain_ms']:.1f}",
         f"{t['ratio']:.2f} [{t['ratio_min']:.2f}, {t['ratio_max']:.2f}]",
         f"{res['adapter_grad_rel_diff']:.1e}"],
        [f"one projection ({layer['shape']})", f"{layer['ours_temp_bytes'] / MIB:.1f}",
         f"{layer['plain_temp_bytes'] / MIB:.1f}",
         f"{layer['ours_temp_bytes'] / max(layer['plain_temp_bytes'], 1):.3f}",
         f"{lt['ours_ms']:.2f}", f"{lt['plain_ms']:.2f}",
         f"{lt['ratio']:.2f} [{lt['ratio_min']:.2f}, {lt['ratio_max']:.2f}]",
         f"{layer['grad_rel_diff']:.1e}"],
    ]  # fmt: skip
    head = ["what", "temp MiB", "plain temp MiB", "temp ratio", "ms", "plain ms",
            "time ratio [min, max]", "grads apart (rel)"]  # fmt: skip
    return markdown_table(head, rows)


# ------------------------------------------------------------------------------- main
def main(argv=None):
    """Runs the suites and writes the JSON and markdown results."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="fewer runs")
    g.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    args = p.parse_args(argv)
    size = "smoke" if args.smoke else "full"
    runs = 1 if args.smoke else (3 if args.quick else 5)
    cmd = "PYTHONPATH=. python benchmarks/fine_tuning.py" + " --quick" * args.quick
    cmd += " --smoke" * args.smoke
    ceilings = matmul_ceilings(256 if args.smoke else 2048, 2 if args.smoke else 5)
    print(f"matmul ceilings (GFLOP/s): f32 {ceilings['float32']:.0f}, "
          f"bf16 x bf16 -> f32 {ceilings['bfloat16']:.0f}", flush=True)  # fmt: skip
    res = {
        "command": cmd,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "matmul_ceilings_gflops": ceilings,
        "preference": preference_suite(size, runs),
        "lora": lora_suite(size, runs),
    }
    md = [
        "# Fine-tuning: fused preference losses and LoRA against their plain forms",
        "",
        f"Matmul ceilings of this machine: f32 {ceilings['float32']:.0f} GFLOP/s, "
        f"bf16 x bf16 -> f32 {ceilings['bfloat16']:.0f} GFLOP/s. Measured {res['when']}.",
        "",
        f"## linear_preference_loss ({res['preference']['config']})",
        "",
        preference_table(res["preference"]),
        "",
        f"## LoRA ({res['lora']['config']})",
        "",
        "Plain: the same model with `x @ w + s * (x @ a @ b)` (flax.nnx `LoRALinear`'s form) "
        "and plain-JAX operators; ours: `cannjax.models.llama_loss(..., lora=...)`, whose "
        "other operators are cannjax's too. The second row isolates `ops.lora_linear`.",
        "",
        lora_table(res["lora"]),
    ]
    write_results("fine_tuning", res, "\n".join(md))
    return res


if __name__ == "__main__":
    main()
