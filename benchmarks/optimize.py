"""cannjax.optimize on training steps written as flax.nnx, equinox and plain-JAX users write them.

Run: ``PYTHONPATH=. python benchmarks/optimize.py [--quick | --smoke] [--models NAME ...]``
(``--quick``: fewer repeats, two compile-time rounds, one level-3 budget; ``--smoke``: as
``--quick`` on tiny models with one compile round, to check that the suite still runs;
its figures mean nothing).

The targets of issue 16. Models from ``benchmarks/_user_models.py`` and
``cannjax.models`` at the GPT shape of ``benchmarks/gpt.py`` (4 layers, width 256, 4
heads, T=256, B=8, V=1024): flax.nnx GPT with its layers in a Python list (``nnx``) and
under ``nnx.scan`` (``nnx_scan``), the equinox GPT (``eqx``), a plain-``jnp`` MLP
classifier (``mlp``, batch 2048, 784-512-512-10) and the plain-JAX twin of cannjax's GPT
(``twin``, ``cannjax.models.plain_gpt_loss``), and both flax.nnx GPTs in mixed
precision (``nnx_bf16``, ``nnx_scan_bf16``: ``dtype=jnp.bfloat16``, float32 parameters,
the target of issue 45 being a step 2.5x as fast as the unoptimized one). Each step is
``value_and_grad(loss)`` plus an ``optax.adam`` update, jitted as each library's users
write it (``nnx.jit`` + ``nnx.value_and_grad`` + ``nnx.Optimizer``; ``eqx.filter_jit`` +
``eqx.filter_value_and_grad``; ``jax.jit`` + ``jax.value_and_grad``), once with ``loss``
and once with ``cannjax.optimize(loss)`` (level 2), side by side in one process:

* gradients: ``max |g_opt - g| / max |g|`` over the leaves, and whether every element
  meets ``|g_opt - g| <= 1e-6 + 1e-5 |g|``;
* residual bytes of the loss's gradient (``cannjax.inspect.optimize``), ratio <= 0.5;
* compiled temp memory of the step, ratio <= 0.6; step time (interleaved medians), <= 0.8;
* trace-and-compile time: ``step.lower(...).compile()`` of a freshly built step (and, for
  the optimized one, a fresh ``cannjax.optimize(loss)``), plain and optimized alternating,
  median of the rounds, ratio <= 1.5. optimize's idiom templates are traced once per
  process; that happens before the timed rounds (in the gradient check), as in a training
  script that compiles its step once;
* the inspect report's replacement counts per kind.

For the twin, the optimized step is also compared with the hand-written cannjax GPT
(``cannjax.models.gpt_loss``, same parameters): time and temp memory within 10%.
Level 3 (the scanned models): budgets between the gradient's temp memory with
``jax.checkpoint`` on every layer of the plain model and at level 2, and at the
checkpointed figure; the gradient's compiled temp memory must fit the budget, and the
step must be no slower than the checkpointed plain step (``GPTConfig(remat="layer")``
for the twin; ``nnx.remat`` inside the ``nnx.scan`` for flax) when it uses no more memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _user_models as um  # noqa: E402
from _harness import RESULTS, interleaved_times, markdown_table, round_order, write_results  # noqa: E402
from gpt import matmul_ceilings, model_flops  # noqa: E402

import cannjax  # noqa: E402
from cannjax import models  # noqa: E402

MIB = 2**20
RTOL, ATOL = 1e-5, 1e-6
TARGETS = {"residual": 0.5, "temp": 0.6, "time": 0.8, "compile": 1.5, "hand": 1.10}
MODELS = ("nnx", "nnx_scan", "eqx", "mlp", "twin", "nnx_bf16", "nnx_scan_bf16")
# The mixed-precision models: flax.nnx with dtype=bfloat16 (param_dtype float32).
BF16_SUFFIX = "_bf16"
MLP_BATCH, MLP_SIZES = 2048, (784, 512, 512, 10)
# --smoke: tiny models (the GPT shape and the MLP's batch and sizes).
SMOKE_SHAPE = um.Shape(vocab=64, width=32, heads=2, layers=2, seq_len=16, batch=2)
SMOKE_MLP = (64, (32, 16, 16, 10))


# --------------------------------------------------------------------------- the steps
def jax_step(loss_fn, opt):
    """The plain-JAX step: ``jax.jit`` of value_and_grad plus an optax update."""

    def step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step)


def eqx_step(loss_fn, opt):
    """The equinox step: ``eqx.filter_jit`` and ``eqx.filter_value_and_grad``."""

    @eqx.filter_jit
    def step(model, opt_state, *batch):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, *batch)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


def nnx_step(loss_fn, opt):
    """The flax.nnx step: ``nnx.jit``, ``nnx.value_and_grad`` and ``nnx.Optimizer``."""
    del opt  # the optimizer is an argument (an nnx.Optimizer)

    @nnx.jit
    def step(model, optimizer, *batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, *batch)
        optimizer.update(model, grads)
        return loss

    return step


@dataclasses.dataclass
class Case:
    """One model: its loss, arguments, and how its library's users build the step.

    ``lib`` is ``"jax"``, ``"eqx"`` or ``"nnx"``; ``args`` are the loss's arguments (model
    or parameters first); ``remat_loss`` is the same plain model with ``jax.checkpoint``
    on every layer (scanned models only); ``hand_loss`` is the hand-written cannjax model.
    """

    name: str
    lib: str
    loss: Callable[..., jax.Array]
    args: tuple
    flops: float
    remat_loss: Callable[..., jax.Array] | None = None
    hand_loss: Callable[..., jax.Array] | None = None
    # A half-precision model: the same model computing in float32 (its gradients are
    # the reference both half steps are compared with).
    float32_args: tuple | None = None
    opt: Any = dataclasses.field(default_factory=lambda: optax.adam(1e-3))

    def make_step(self, loss_fn):
        """A freshly built jitted step around ``loss_fn``."""
        make = {"jax": jax_step, "eqx": eqx_step, "nnx": nnx_step}[self.lib]
        return make(loss_fn, self.opt)

    def step_args(self) -> tuple:
        """Fresh step arguments (an nnx model is cloned: its step updates it in place)."""
        first, *batch = self.args
        if self.lib == "nnx":
            model = nnx.clone(first)
            return (model, nnx.Optimizer(model, self.opt, wrt=nnx.Param), *batch)
        params = eqx.filter(first, eqx.is_array) if self.lib == "eqx" else first
        return (first, self.opt.init(params), *batch)

    def grads(self, loss_fn) -> list[np.ndarray]:
        """The gradient leaves of ``loss_fn`` at ``args`` (w.r.t. the model/params)."""
        if self.lib == "nnx":
            g = nnx.jit(nnx.grad(loss_fn))(*self.args)
        elif self.lib == "eqx":
            g = eqx.filter_jit(eqx.filter_grad(loss_fn))(*self.args)
        else:
            g = jax.jit(jax.grad(loss_fn))(*self.args)
        return [np.asarray(x) for x in jax.tree.leaves(g)]


def nnx_remat_loss(model: um.NnxGPT, tokens, targets):
    """``um.nnx_loss`` of a scanned ``NnxGPT`` with ``nnx.remat`` on every layer."""
    x = model.embed(tokens) + model.pos(jnp.arange(tokens.shape[-1]))
    mask = nnx.make_causal_mask(tokens)

    @nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
    @nnx.remat
    def run(x, block, mask):
        return block(x, mask)

    logits = model.head(model.ln_f(run(x, model.blocks, mask)))
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def twin_case(cfg: models.GPTConfig, args: tuple, flops: float) -> Case:
    """The plain-JAX twin of cannjax's GPT, its checkpointed form and the hand-written one."""
    cfg_remat = dataclasses.replace(cfg, remat="layer")  # jax.checkpoint on every layer

    def twin_loss(params, tokens, targets):
        return models.plain_gpt_loss(params, tokens, targets, cfg)

    def twin_remat_loss(params, tokens, targets):
        return models.plain_gpt_loss(params, tokens, targets, cfg_remat)

    def hand_loss(params, tokens, targets):
        return models.gpt_loss(params, tokens, targets, cfg)

    return Case("twin", "jax", twin_loss, args, flops, twin_remat_loss, hand_loss)


def make_cases(names, s: um.Shape | None = None, mlp=(MLP_BATCH, MLP_SIZES)) -> dict[str, Case]:
    """The cases ``names`` at GPT shape ``s`` (default ``um.Shape()``), MLP ``(batch, sizes)``."""
    s = s or um.Shape()
    mlp_batch, mlp_sizes = mlp
    tokens, targets = um.batch(s)
    cfg = models.GPTConfig(
        vocab=s.vocab, width=s.width, heads=s.heads, layers=s.layers, seq_len=s.seq_len
    )
    gpt_flops = model_flops(cfg, s.batch)
    cases = {}
    for name in names:
        if name.removesuffix(BF16_SUFFIX) in ("nnx", "nnx_scan"):
            scan = name.removesuffix(BF16_SUFFIX) == "nnx_scan"
            half = dataclasses.replace(s, dtype=jnp.bfloat16) if name.endswith(BF16_SUFFIX) else s
            model = um.NnxGPT(half, scan=scan, rngs=nnx.Rngs(0))
            remat = nnx_remat_loss if scan else None
            case = Case(name, "nnx", um.nnx_loss, (model, tokens, targets), gpt_flops, remat)
            if half is not s:  # the same parameters (float32 either way), computing in f32
                wide = um.NnxGPT(s, scan=scan, rngs=nnx.Rngs(0))
                case.float32_args = (wide, tokens, targets)
            cases[name] = case
        elif name == "eqx":
            model = um.EqxGPT(s, jax.random.key(0))
            cases[name] = Case(name, "eqx", um.eqx_loss, (model, tokens, targets), gpt_flops)
        elif name == "mlp":
            kx, ky = jax.random.split(jax.random.key(2))
            x = jax.random.normal(kx, (mlp_batch, mlp_sizes[0]), jnp.float32)
            y = jax.random.randint(ky, (mlp_batch,), 0, mlp_sizes[-1])
            params = um.init_mlp(jax.random.key(0), mlp_sizes)
            macs = sum(m * n for m, n in zip(mlp_sizes[:-1], mlp_sizes[1:]))
            cases[name] = Case(name, "jax", um.mlp_loss, (params, x, y), 3 * 2 * mlp_batch * macs)
        elif name == "twin":
            params = models.init_gpt(jax.random.key(0), cfg)
            cases[name] = twin_case(cfg, (params, tokens, targets), gpt_flops)
    return cases


# --------------------------------------------------------------------------- measures
def _rel_err(got: list[np.ndarray], ref: list[np.ndarray]) -> float:
    scale = max(float(np.max(np.abs(r))) for r in ref)
    return max(float(np.max(np.abs(g - r))) for g, r in zip(got, ref)) / scale


def grad_agreement(case: Case, opt_loss) -> dict[str, Any]:
    """The optimized gradient against the plain one: elementwise within ``ATOL + RTOL
    |g|``; for a half-precision model, no farther from the float32 model's gradient than
    the plain half step's (1.25x, both rounded in bfloat16)."""
    ref, got = case.grads(case.loss), case.grads(opt_loss)
    out = {"max_rel_err": _rel_err(got, ref), "leaves": len(ref)}
    if case.float32_args is None:
        close = all(np.all(np.abs(g - r) <= ATOL + RTOL * np.abs(r)) for g, r in zip(got, ref))
        return {**out, "allclose": bool(close)}
    f32 = dataclasses.replace(case, args=case.float32_args).grads(case.loss)
    plain_err, opt_err = _rel_err(ref, f32), _rel_err(got, f32)
    return {
        **out,
        "plain_vs_float32": plain_err,
        "opt_vs_float32": opt_err,
        "allclose": bool(opt_err <= 1.25 * plain_err),
    }


def compile_times(case: Case, losses: dict[str, Callable[[], Callable]], rounds: int):
    """Trace-and-compile seconds of freshly built steps, and their temp bytes.

    The steps alternate, the order rotating each round (none always goes first).
    """
    args = case.step_args()
    secs: dict[str, list[float]] = {k: [] for k in losses}
    temp = {}
    names = list(losses)
    for i in range(rounds):
        for k in (names[j] for j in round_order(len(names), i)):
            fresh_loss = losses[k]
            t0 = time.perf_counter()
            compiled = case.make_step(fresh_loss()).lower(*args).compile()
            secs[k].append(time.perf_counter() - t0)
            temp[k] = step_temp(compiled)
    return {k: statistics.median(v) for k, v in secs.items()}, secs, temp


def step_temp(compiled) -> int:
    """Compiled temp bytes (an ``eqx.filter_jit`` step's compiled object wraps jax's)."""
    compiled = getattr(compiled, "compiled", compiled)
    return int(compiled.memory_analysis().temp_size_in_bytes)


def step_times(case: Case, losses: dict[str, Callable], repeats: int):
    """Interleaved step times (s) of the steps around ``losses``, each on its own state."""
    runs = []
    for loss_fn in losses.values():
        step, args = case.make_step(loss_fn), case.step_args()
        runs.append(lambda step=step, args=args: step(*args))
    return dict(zip(losses, interleaved_times(runs, repeats=repeats)))


def grad_temp(loss_fn, *args) -> int:
    """Compiled temp bytes of the gradient w.r.t. the first argument (level 3's measure)."""
    return cannjax.inspect.memory(loss_fn, *args, argnums=0).temp_bytes


def measure(case: Case, repeats: int, rounds: int) -> dict[str, Any]:
    opt_loss = cannjax.optimize(case.loss)
    out: dict[str, Any] = {"grads": grad_agreement(case, opt_loss)}
    rep = cannjax.inspect.optimize(case.loss, *case.args)
    out["counts"] = rep.counts()
    out["left"] = len(rep.left)
    out["residual_bytes"] = list(rep.residual_bytes)
    out["grad_temp_bytes"] = list(rep.temp_bytes)
    fresh = {
        "plain": lambda: lambda *a: case.loss(*a),
        "optimize": lambda: cannjax.optimize(lambda *a: case.loss(*a)),
    }
    if case.hand_loss is not None:
        fresh["hand"] = lambda: lambda *a: case.hand_loss(*a)
    med, secs, temp = compile_times(case, fresh, rounds)
    out["compile_s"], out["compile_samples_s"], out["step_temp_bytes"] = med, secs, temp
    losses = {"plain": case.loss, "optimize": opt_loss}
    if case.hand_loss is not None:
        losses["hand"] = case.hand_loss
    times = step_times(case, losses, repeats)
    out["time_s"] = {k: v["median_s"] for k, v in times.items()}
    out["iqr_rel"] = {k: v["iqr_rel"] for k, v in times.items()}
    return out


def measure_level3(case: Case, l2: int, repeats: int, quick: bool) -> dict[str, Any]:
    """Level 3 at budgets set from the checkpointed and level-2 (``l2``) gradient memory."""
    ckpt = grad_temp(case.remat_loss, *case.args)
    budgets = (
        {"at checkpoint": ckpt} if quick else {"midway": (ckpt + l2) // 2, "at checkpoint": ckpt}
    )
    out: dict[str, Any] = {"ckpt_grad_temp": ckpt, "l2_grad_temp": l2, "budgets": {}}
    losses = {"checkpoint": case.remat_loss}
    for label, budget in budgets.items():
        f = cannjax.optimize(case.loss, level=3, memory_budget=int(budget))
        r: dict[str, Any] = {"budget": int(budget)}
        try:
            r["grad_temp"] = grad_temp(f, *case.args)
            r["policy"] = f.optimize_entry(*case.args).remat.policy
        except ValueError as e:
            r["error"] = str(e).splitlines()[0]
            out["budgets"][label] = r
            continue
        r["step_temp"] = step_temp(case.make_step(f).lower(*case.step_args()).compile())
        out["budgets"][label] = r
        losses[label] = f
    args = case.step_args()
    out["ckpt_step_temp"] = step_temp(case.make_step(case.remat_loss).lower(*args).compile())
    times = step_times(case, losses, repeats)
    out["time_s"] = {k: v["median_s"] for k, v in times.items()}
    out["iqr_rel"] = {k: v["iqr_rel"] for k, v in times.items()}
    return out


# --------------------------------------------------------------------------- report
def mark(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def ratio_cell(x: float, target: float) -> str:
    return f"{x:.2f} {mark(x <= target)}"


def precision(name: str) -> str:
    """The matmul precision of a model of the suite (the ceiling its throughput is quoted
    against)."""
    return "bfloat16" if name.endswith(BF16_SUFFIX) else "float32"


def main_rows(res: dict, ceilings: dict[str, float]) -> list[list[str]]:
    rows = []
    for name, r in res.items():
        if "error" in r:
            rows.append([name, f"error: {r['error'][:160]}"] + ["-"] * (len(MAIN_HEAD) - 2))
            continue
        g, t, c = r["grads"], r["time_s"], r["compile_s"]
        rb, ra = r["residual_bytes"]
        tb, ta = r["step_temp_bytes"]["plain"], r["step_temp_bytes"]["optimize"]
        gflops = r["flops"] / t["optimize"] / 1e9
        rows.append(
            [
                name,
                f"{g['max_rel_err']:.1e} {mark(g['allclose'])}",
                f"{rb / MIB:.1f} / {ra / MIB:.1f}",
                ratio_cell(ra / rb, TARGETS["residual"]),
                f"{tb / MIB:.1f} / {ta / MIB:.1f}",
                ratio_cell(ta / max(tb, 1), TARGETS["temp"]),
                f"{1e3 * t['plain']:.0f} / {1e3 * t['optimize']:.0f} "
                f"(±{r['iqr_rel']['plain']:.0%}/{r['iqr_rel']['optimize']:.0%})",
                ratio_cell(t["optimize"] / t["plain"], TARGETS["time"]),
                f"{c['plain']:.1f} / {c['optimize']:.1f}",
                ratio_cell(c["optimize"] / c["plain"], TARGETS["compile"]),
                f"{gflops:.0f} ({gflops / ceilings[precision(name)]:.0%})",
                ", ".join(f"{k} {n}" for k, n in r["counts"].items()) + f"; left {r['left']}",
            ]
        )
    return rows


MAIN_HEAD = [
    "model",
    "grad rel err (allclose)",
    "residual MiB plain / opt",
    "ratio (<= 0.5)",
    "step temp MiB plain / opt",
    "ratio (<= 0.6)",
    "step ms plain / opt (spread)",
    "ratio (<= 0.8)",
    "compile s plain / opt",
    "ratio (<= 1.5)",
    "opt GFLOP/s (of ceiling)",
    "inspect counts",
]


def hand_rows(r: dict) -> list[list[str]]:
    t, m = r["time_s"], r["step_temp_bytes"]
    return [
        [
            f"{1e3 * t['hand']:.0f} (±{r['iqr_rel']['hand']:.0%})",
            f"{1e3 * t['optimize']:.0f}",
            ratio_cell(t["optimize"] / t["hand"], TARGETS["hand"]),
            f"{m['hand'] / MIB:.0f}",
            f"{m['optimize'] / MIB:.0f}",
            ratio_cell(m["optimize"] / m["hand"], TARGETS["hand"]),
        ]
    ]


def level3_rows(res: dict) -> list[list[str]]:
    rows = []
    for name, r in res.items():
        t = r["time_s"]
        for label, b in r["budgets"].items():
            if "error" in b:
                rows.append([name, label, f"{b['budget'] / MIB:.1f}", b["error"]] + ["-"] * 5)
                continue
            fits = b["grad_temp"] <= b["budget"]
            no_more = b["step_temp"] <= r["ckpt_step_temp"]
            ratio = t[label] / t["checkpoint"]
            timed = f"{ratio:.2f} " + (mark(ratio <= 1.0) if no_more else "(uses more memory)")
            rows.append(
                [
                    name,
                    label,
                    f"{b['budget'] / MIB:.1f}",
                    b["policy"],
                    f"{b['grad_temp'] / MIB:.1f} {mark(fits)}",
                    f"{r['ckpt_grad_temp'] / MIB:.1f} / {r['l2_grad_temp'] / MIB:.1f}",
                    f"{b['step_temp'] / MIB:.1f} / {r['ckpt_step_temp'] / MIB:.1f}",
                    f"{1e3 * t[label]:.0f} / {1e3 * t['checkpoint']:.0f}",
                    timed,
                ]
            )
    return rows


L3_HEAD = [
    "model",
    "budget",
    "budget MiB",
    "policy chosen",
    "grad temp MiB (fits)",
    "grad temp MiB checkpoint / level 2",
    "step temp MiB L3 / checkpoint",
    "step ms L3 / checkpoint",
    "time ratio (<= 1.0)",
]


def plot(res: dict, path: Path) -> None:
    """Ratios optimized / plain per model, with each target marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    metrics = (("residual", "residuals"), ("temp", "step temp"), ("time", "step time"),
               ("compile", "compile time"))  # fmt: skip
    fig, ax = plt.subplots(figsize=(6.5, 3.4), dpi=90)
    names = [n for n in res if "error" not in res[n]]
    if not names:
        return
    x = np.arange(len(names))
    w = 0.8 / len(metrics)
    for i, (key, label) in enumerate(metrics):
        vals = []
        for n in names:
            r = res[n]
            vals.append(
                {
                    "residual": r["residual_bytes"][1] / r["residual_bytes"][0],
                    "temp": r["step_temp_bytes"]["optimize"]
                    / max(r["step_temp_bytes"]["plain"], 1),
                    "time": r["time_s"]["optimize"] / r["time_s"]["plain"],
                    "compile": r["compile_s"]["optimize"] / r["compile_s"]["plain"],
                }[key]
            )
        xs = x - 0.4 + (i + 0.5) * w
        bars = ax.bar(xs, vals, w, label=label)
        ax.hlines([TARGETS[key]] * len(xs), xs - w / 2, xs + w / 2, colors="k", lw=1)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    ax.axhline(1.0, color="grey", lw=0.5, ls=":")
    ax.set_xticks(x, names)
    ax.set_ylabel("cannjax.optimize / plain")
    ax.set_title("optimize (level 2) vs the unoptimized step; black ticks: targets", fontsize=8)
    ax.legend(fontsize=7, ncols=4, loc="upper center")
    ax.margins(y=0.2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer repeats and compile rounds")
    size.add_argument(
        "--smoke", action="store_true", help="tiny models, as --quick: checks that it runs"
    )
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (15; --quick 4)")
    a = p.parse_args(argv)
    quick = a.quick or a.smoke
    repeats = a.repeats or (2 if a.smoke else 4 if a.quick else 15)
    rounds = 1 if a.smoke else 2 if a.quick else 3
    s, (mlp_batch, mlp_sizes) = (
        (SMOKE_SHAPE, SMOKE_MLP) if a.smoke else (um.Shape(), (MLP_BATCH, MLP_SIZES))
    )
    cases = make_cases(a.models, s, (mlp_batch, mlp_sizes))

    def ceilings_now() -> dict[str, float]:
        return matmul_ceilings(256, 2) if a.smoke else matmul_ceilings()

    ceilings = ceilings_now()  # measured again at the end: the best of the two is quoted
    print(f"matmul ceilings {ceilings} GFLOP/s", flush=True)
    res, l3 = {}, {}
    for name, case in cases.items():
        t0 = time.perf_counter()
        try:
            res[name] = {"flops": case.flops, **measure(case, repeats, rounds)}
        except Exception as e:  # reported as the model's row; the other models still run
            res[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
        print(markdown_table(MAIN_HEAD, main_rows({name: res[name]}, ceilings)), flush=True)
        if case.remat_loss is not None and "error" not in res[name]:
            l3[name] = measure_level3(case, res[name]["grad_temp_bytes"][1], repeats, quick)
            print(markdown_table(L3_HEAD, level3_rows({name: l3[name]})), flush=True)
        print(f"({name}: {time.perf_counter() - t0:.0f} s)", flush=True)

    ceilings = {k: max(v, w) for (k, v), w in zip(ceilings.items(), ceilings_now().values())}
    ceiling = ceilings["float32"]
    command = "PYTHONPATH=. python benchmarks/optimize.py" + (
        " --smoke" if a.smoke else " --quick" if a.quick else ""
    )
    if a.models != list(MODELS):
        command += " --models " + " ".join(a.models)
    parts = [
        f"# cannjax.optimize\n\nCommand: `{command}`; {jax.default_backend()}, jax "
        f"{jax.__version__}. Step = value_and_grad + optax.adam, jitted as each library's "
        f"users write it; GPT L={s.layers} D={s.width} N={s.heads} T={s.seq_len} V={s.vocab} "
        f"B={s.batch}; MLP {'-'.join(map(str, mlp_sizes))}, batch {mlp_batch}. Times: "
        f"medians of {repeats} interleaved rounds (± IQR/median), shared 2-core CPU; "
        f"compile: median of {rounds} alternating round(s) of a freshly built step. "
        f"Matmul ceilings (2048^3, best of a measure before and after): float32 "
        f"{ceiling:.0f}, bfloat16 x bfloat16 -> float32 {ceilings['bfloat16']:.0f} GFLOP/s; "
        f"the `{BF16_SUFFIX}` models (flax.nnx with `dtype=jnp.bfloat16`, float32 "
        "parameters) are quoted against the bfloat16 one. Ratios are optimized / plain, each with "
        "its target of issue 16 (set there for the transformers; shown for all).",
        "## Level 2 against the unoptimized step\n\n"
        "grad rel err: max |g_opt - g| / max |g|; pass when every element meets "
        f"|g_opt - g| <= {ATOL:g} + {RTOL:g} |g|; for the `{BF16_SUFFIX}` models, when the "
        "optimized gradient is no farther from the float32 model's than the plain bf16 "
        "step's is (1.25x; both in the JSON). Residuals: what the loss's backward "
        "saves (`cannjax.inspect.optimize`). Inspect counts: replacements per kind (the "
        "scanned models count the scan body once); left: equations left alone.\n\n"
        + markdown_table(MAIN_HEAD, main_rows(res, ceilings)),
    ]
    if "twin" in res and "error" not in res["twin"]:
        parts.append(
            "## Optimized twin against the hand-written cannjax GPT\n\n"
            "`cannjax.optimize(cannjax.models.plain_gpt_loss)` against "
            "`cannjax.models.gpt_loss` (same parameters, same step); target: within 10%.\n\n"
            + markdown_table(
                [
                    "hand ms",
                    "optimized ms",
                    "time ratio",
                    "hand temp MiB",
                    "optimized MiB",
                    "memory ratio",
                ],
                hand_rows(res["twin"]),
            )  # fmt: skip
        )
    if l3:
        parts.append(
            "## Level 3 under a memory budget\n\n"
            "Budgets in bytes of the gradient's compiled temp memory (optimize's measure), "
            "set between the plain model with `jax.checkpoint` on every layer and level 2, "
            "and at the checkpointed figure. Time against the checkpointed plain step, "
            "judged where level 3 uses no more step memory.\n\n"
            + markdown_table(L3_HEAD, level3_rows(l3))
        )
    table = "\n\n".join(parts)
    payload = {
        "command": command,
        "repeats": repeats,
        "compile_rounds": rounds,
        "matmul_ceiling_gflops": ceiling,
        "matmul_ceilings_gflops": ceilings,
        "targets": TARGETS,
        "tolerance": {"rtol": RTOL, "atol": ATOL},
        "level2": res,
        "level3": l3,
    }
    write_results("optimize", payload, table)
    plot(res, RESULTS / "optimize.png")
    print(table)


if __name__ == "__main__":
    main()
