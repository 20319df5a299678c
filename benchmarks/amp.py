"""Mixed precision and dynamic loss scaling: accuracy and per-step overhead.

Run: ``PYTHONPATH=. python benchmarks/amp.py [--quick]``. Writes
``amp.json``, ``amp.md`` and ``amp.png``
to the results folder (``build/bench/results/``, or ``benchmarks/results/`` under
``cannjax bench --write``: see ``benchmarks/_harness.py``).

1. The float16 experiment: an MLP (32 -> 128 -> 128 -> 1, tanh) regressing a noisy
   random sine target (4096 points), loss weighted by 1e-4, 200 Adam steps (lr 1e-3),
   params in float32. Configurations: float32; float16 compute without scaling;
   float16 with DynamicLossScale (defaults); float16 with a dynamic scale that starts
   at 2**24 and grows every 20 steps (to show backoff and growth: the plot); bfloat16.
   Reports the final float32 MSE (without the 1e-4 weight) and the share of gradient
   entries that are exactly zero at the last step.
2. Overhead: the same jitted float16 training step (MLP, Adam, state donated) without
   loss scaling (baseline), with cannjax (value_and_grad + skip_nonfinite given the
   flag; and with warn=True), with jmp's
   DynamicLossScale (+ select_tree) and with flax's DynamicScale (+ jnp.where),
   interleaved A B C D (rotating the start) after warm-up, median over rounds, ratio to
   the baseline of the same round with the interquartile spread. Also the compiled
   temp memory of each step.
3. Facts checked in the same process: which hyperparameters survive ``jax.jit`` and
   when each scale first grows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _harness import RESULTS, round_order

from cannjax import amp


# ----------------------------------------------------------------------------- model
def init_mlp(key, sizes):
    params = []
    for k, (a, b) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:])):
        params.append((jax.random.normal(k, (a, b)) / np.sqrt(a), jnp.zeros(b)))
    return params


def mlp(params, x):
    for i, (w, b) in enumerate(params):
        x = x @ w + b
        if i < len(params) - 1:
            x = jnp.tanh(x)
    return x


def make_data(key, n, d):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    x = jax.random.normal(k1, (n, d))
    w1 = jax.random.normal(k2, (d, 64))
    w2 = jax.random.normal(k3, (64, 1)) / 8
    y = jnp.sin(0.75 * x @ w1) @ w2 + 0.2 * jax.random.normal(k4, (n, 1))
    return x, y


def mse(params, x, y, compute):
    f = amp.with_policy(mlp, policy=f"params=float32,compute={compute},output=float32")
    return jnp.mean((f(params, x) - y) ** 2)


# ------------------------------------------------------------------ 1. the experiment
def train(compute, loss_scale, *, steps, weight=1e-4, lr=1e-3, seed=0):
    x, y = make_data(jax.random.PRNGKey(1), 4096, 32)
    params = init_mlp(jax.random.PRNGKey(seed), [32, 128, 128, 1])
    opt = amp.skip_nonfinite(optax.adam(lr))
    state = opt.init(params)

    @jax.jit
    def step(params, state, ls):
        r = amp.value_and_grad(lambda p: weight * mse(p, x, y, compute), ls)(params)
        zeros = sum(jnp.sum(g == 0) for g in jax.tree_util.tree_leaves(r.grads))
        updates, state = opt.update(r.grads, state, params, grads_finite=r.grads_finite)
        return optax.apply_updates(params, updates), state, r.loss_scale, r.grads_finite, zeros

    scales, finite = [], []
    ls = loss_scale
    for _ in range(steps):
        scales.append(float(ls.loss_scale))
        params, state, ls, ok, zeros = step(params, state, ls)
        finite.append(bool(ok))
    n = sum(g.size for g in jax.tree_util.tree_leaves(params))
    return {
        "final_mse": float(mse(params, x, y, "float32")),
        "zero_grad_fraction_last_step": float(zeros) / n,
        "skipped_steps": int(state.num_skipped),
        "final_loss_scale": float(ls.loss_scale),
        "history": {"loss_scale": scales, "finite": finite},
    }


def experiment(steps):
    runs = {
        "float32": ("float32", amp.NoOpLossScale(), 1e-4),
        "float16, no scaling": ("float16", amp.NoOpLossScale(), 1e-4),
        "float16, DynamicLossScale()": ("float16", amp.DynamicLossScale(), 1e-4),
        "bfloat16, no scaling": ("bfloat16", amp.NoOpLossScale(), 1e-4),
        # Loss weight 1: scale 2**24 overflows, so the plot shows backoff and growth.
        PLOT_RUN: ("float16", amp.DynamicLossScale(2.0**24, growth_interval=20), 1.0),
    }
    return {name: train(c, ls, steps=steps, weight=w) for name, (c, ls, w) in runs.items()}


PLOT_RUN = "float16, loss weight 1, dynamic from 2**24, growth_interval=20"


# ------------------------------------------------------------------- 2. the overhead
def overhead(rounds, inner, sizes, batch):
    import jmp
    from flax.training.dynamic_scale import DynamicScale

    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (batch, sizes[0]))
    y = jax.random.normal(jax.random.PRNGKey(1), (batch, sizes[-1]))
    params = init_mlp(jax.random.PRNGKey(2), sizes)
    adam = optax.adam(1e-3)

    def loss_fn(p):
        return mse(p, x, y, "float16")

    def base_step(carry):
        params, st, _ = carry
        grads = jax.grad(loss_fn)(params)
        u, st = adam.update(grads, st, params)
        return optax.apply_updates(params, u), st, None

    opt = amp.skip_nonfinite(adam)

    def cannjax_step(carry, warn=False):
        params, st, ls = carry
        r = amp.value_and_grad(loss_fn, ls, warn=warn)(params)
        u, st = opt.update(r.grads, st, params, grads_finite=r.grads_finite)
        return optax.apply_updates(params, u), st, r.loss_scale

    def jmp_step(carry):
        params, st, ls = carry
        grads = jax.grad(lambda p: ls.scale(loss_fn(p)))(params)
        grads = ls.unscale(grads)
        ok = jmp.all_finite(grads)
        ls = ls.adjust(ok)
        u, new_st = adam.update(grads, st, params)
        new_params = optax.apply_updates(params, u)
        params, st = jmp.select_tree(ok, (new_params, new_st), (params, st))
        return params, st, ls

    def flax_step(carry):
        params, st, ds = carry
        ds, ok, _, grads = ds.value_and_grad(loss_fn)(params)
        u, new_st = adam.update(grads, st, params)
        new_params = optax.apply_updates(params, u)
        sel = lambda a, b: jnp.where(ok, a, b)  # noqa: E731
        params = jax.tree_util.tree_map(sel, new_params, params)
        st = jax.tree_util.tree_map(sel, new_st, st)
        return params, st, ds

    variants = {
        "float16, no scaling": (base_step, adam.init(params), None),
        "cannjax.amp": (cannjax_step, opt.init(params), amp.DynamicLossScale()),
        "cannjax.amp, warn=True": (
            lambda c: cannjax_step(c, warn=True),
            opt.init(params),
            amp.DynamicLossScale(),
        ),
        "jmp": (jmp_step, adam.init(params), jmp.DynamicLossScale(jnp.float32(2.0**15))),
        "flax DynamicScale": (flax_step, adam.init(params), DynamicScale()),
    }
    jitted, carries, memory = {}, {}, {}
    for name, (fn, st, ls) in variants.items():
        j = jax.jit(fn, donate_argnums=0)  # training steps donate their state
        carry = (params, st, ls)
        # Lowered from the flat leaves: jmp's tree_unflatten rejects jit's abstract
        # ArgInfo leaves in .lower() (its __post_init__ calls eval_shape on them).
        leaves, treedef = jax.tree_util.tree_flatten(carry)
        flat = jax.jit(
            lambda lv, fn=fn, td=treedef: fn(jax.tree_util.tree_unflatten(td, lv)),
            donate_argnums=0,
        )
        compiled = flat.lower(leaves).compile()
        memory[name] = int(compiled.memory_analysis().temp_size_in_bytes)
        carry = jax.tree_util.tree_map(jnp.copy, carry)  # own buffers to donate
        for _ in range(3):  # warm-up
            carry = j(carry)
        jax.block_until_ready(carry)
        jitted[name], carries[name] = j, carry
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        # interleaved A B C D, the starting variant rotating so no one always goes first
        for name in (names[i] for i in round_order(len(names), r)):
            j, carry = jitted[name], carries[name]
            t0 = time.perf_counter()
            for _ in range(inner):
                carry = j(carry)
            jax.block_until_ready(carry)
            times[name].append((time.perf_counter() - t0) / inner)
            carries[name] = carry
    base = np.asarray(times["float16, no scaling"])
    out = {}
    for name, t in times.items():
        t = np.asarray(t)
        ratio = t / base  # paired per round: same moment, same machine load
        out[name] = {
            "median_ms": float(np.median(t) * 1e3),
            "ratio_median": float(np.median(ratio)),
            "ratio_q25": float(np.quantile(ratio, 0.25)),
            "ratio_q75": float(np.quantile(ratio, 0.75)),
            "temp_bytes": memory[name],
        }
    n = sum(g.size for g in jax.tree_util.tree_leaves(params))
    return {
        "sizes": sizes,
        "batch": batch,
        "params": int(n),
        "rounds": rounds,
        "inner": inner,
        "variants": out,
    }


# ------------------------------------------------------------------------ 3. facts
def facts():
    import jmp
    from flax.training.dynamic_scale import DynamicScale

    ident = jax.jit(lambda s: s)
    ours = ident(amp.DynamicLossScale(4.0, min_loss_scale=2.0, growth_interval=3))
    theirs = ident(
        jmp.DynamicLossScale(jnp.float32(4.0), min_loss_scale=jnp.float32(2.0), period=3)
    )

    def first_growth(adjust, state, scale_of):
        s0 = float(scale_of(state))
        for k in range(1, 10):
            state = adjust(state)
            if float(scale_of(state)) > s0:
                return k
        return None

    t = jnp.array(True)
    fx = DynamicScale(growth_interval=3, scale=4.0)
    flax_growth = None
    for k in range(1, 10):
        fx, *_ = fx.value_and_grad(lambda p: p * 1.0)(jnp.float32(1.0))
        if float(fx.scale) > 4.0:
            flax_growth = k
            break
    return {
        "min_loss_scale after jax.jit (set to 2.0)": {
            "cannjax.amp": ours.min_loss_scale,
            "jmp": float(theirs.min_loss_scale),
        },
        "first growth with growth_interval=3 (finite steps)": {
            "cannjax.amp": first_growth(
                lambda s: s.adjust(t),
                amp.DynamicLossScale(4.0, growth_interval=3),
                lambda s: s.loss_scale,
            ),
            "jmp": first_growth(
                lambda s: s.adjust(t),
                jmp.DynamicLossScale(jnp.float32(4.0), period=3),
                lambda s: s.loss_scale,
            ),
            "flax": flax_growth,
        },
    }


# ----------------------------------------------------------------------------- main
def notes(over: list[dict]) -> str:
    """The notes under the overhead tables: only what this run measured."""
    text = (
        "Notes: the cannjax step passes `grads_finite=` to `skip_nonfinite` (one overflow "
        "check per step) and uses its default `mode='cond'` on CPU (`mode='select'` is not "
        "timed here)."
    )
    if any(o["variants"]["cannjax.amp"]["ratio_median"] < 1 for o in over):
        text += (
            " A ratio below 1 is not work saved (the step does strictly more): with the "
            "optimizer update inside a `lax.cond` XLA:CPU schedules it differently, and that "
            "ran faster here."
        )
    small = over[0]
    v = small["variants"]
    return text + (
        f" `warn=True` puts a host callback in the compiled step: on the {small['params']}-"
        f"parameter MLP the step took {v['cannjax.amp, warn=True']['ratio_median']:.2f}x the "
        f"baseline, against {v['cannjax.amp']['ratio_median']:.2f}x without the callback. "
        "Wall-clock figures on shared cores are noisy: see the quartiles."
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer timing rounds")
    args = ap.parse_args()
    steps = 200
    rounds = 12 if args.quick else 30
    t0 = time.time()
    exp = experiment(steps)
    over = [
        overhead(rounds, 10, [64, 256, 256, 64], 128),  # small: dispatch-bound
        overhead(rounds, 3, [512, 1024, 1024, 512], 256),  # medium: compute-bound
    ]
    result = {
        "command": "PYTHONPATH=. python benchmarks/amp.py" + (" --quick" if args.quick else ""),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus (shared)",
        "experiment": {
            k: {kk: vv for kk, vv in v.items() if kk != "history"} for k, v in exp.items()
        },
        "overhead": over,
        "facts": facts(),
        "wall_s": round(time.time() - t0, 1),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "amp.json").write_text(json.dumps(result, indent=1) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    h = exp[PLOT_RUN]["history"]
    ax = amp.plot_loss_scale(
        h["loss_scale"],
        h["finite"],
        title="float16 MLP (loss weight 1): scale from 2**24, growth every 20",
    )
    ax.figure.savefig(RESULTS / "amp.png", dpi=80)

    f32 = exp["float32"]["final_mse"]
    lines = [
        "# amp: mixed precision and dynamic loss scaling",
        "",
        f"Command: `{result['command']}` ({result['backend']}, {result['machine']}, "
        f"jax {result['jax']}).",
        "",
        f"## float16 experiment (MLP, loss weight 1e-4, {steps} Adam steps)",
        "",
        "| run | final MSE | vs float32 | zero grads (last step) | skipped | final scale |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in exp.items():
        rel = "" if name == PLOT_RUN else f"{r['final_mse'] / f32 - 1:+.3%}"
        lines.append(
            f"| {name} | {r['final_mse']:.4f} | {rel} | "
            f"{r['zero_grad_fraction_last_step']:.2%} | {r['skipped_steps']} | "
            f"{r['final_loss_scale']:g} |"
        )
    for o in over:
        lines += [
            "",
            f"## Overhead per jitted float16 step: MLP {o['sizes']}, batch {o['batch']} "
            f"({o['params']} params)",
            "",
            f"Interleaved (rotating start), {o['rounds']} rounds x {o['inner']} steps; "
            "ratio = per-round "
            "time / baseline time of the same round (median [q25, q75]).",
            "",
            "| step | median ms | ratio | temp bytes |",
            "|---|---|---|---|",
        ]
        for name, v in o["variants"].items():
            lines.append(
                f"| {name} | {v['median_ms']:.3f} | {v['ratio_median']:.3f} "
                f"[{v['ratio_q25']:.3f}, {v['ratio_q75']:.3f}] | {v['temp_bytes']} |"
            )
    lines += ["", notes(over)]
    lines += ["", "## Facts", ""]
    for k, v in result["facts"].items():
        lines.append(f"- {k}: " + ", ".join(f"{a}: {b}" for a, b in v.items()))
    lines.append("")
    (RESULTS / "amp.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
