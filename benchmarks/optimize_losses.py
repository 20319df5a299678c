"""cannjax.optimize on the cross-entropy spellings users write, each after an x @ w head.

The spellings: optax's integer and one-hot losses, ``optax.smooth_labels``, flax's
``onehot(on_value, off_value)``, a z-loss added per row, and a soft cap on the logits.

Run: ``PYTHONPATH=. python benchmarks/optimize_losses.py [--quick | --smoke]``
(``--quick``: fewer repeats; ``--smoke``: tiny shapes, to check that the suite runs).

Each form is the loss of logits ``z = x @ w`` (x ``[B, T, D]``, w ``[D, V]``) written with
optax and flax's own functions, never with cannjax; the step is ``jax.value_and_grad`` over
``(x, w)``, plain against ``cannjax.optimize`` of the same function, side by side in one
process (interleaved medians after warm-up). Memory: the compiled step's temp
(``memory_analysis``) and the residuals its backward saves (``cannjax.inspect.optimize``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import interleaved_times, markdown_table, temp_bytes, write_results  # noqa: E402
from gpt import matmul_ceiling  # noqa: E402

import cannjax  # noqa: E402

EPS, Z_WEIGHT, CAP = 0.1, 1e-4, 30.0


def _z_loss(z):  # PaLM's z-loss per row, as t5x and levanter add it
    return Z_WEIGHT * jnp.square(jax.nn.logsumexp(z, axis=-1))


def optax_integer(x, w, labels):
    return optax.softmax_cross_entropy_with_integer_labels(x @ w, labels).mean()


def optax_one_hot(x, w, labels):
    z = x @ w
    return optax.softmax_cross_entropy(z, jax.nn.one_hot(labels, z.shape[-1])).mean()


def optax_smoothed(x, w, labels):
    z = x @ w
    targets = optax.smooth_labels(jax.nn.one_hot(labels, z.shape[-1]), EPS)
    return optax.softmax_cross_entropy(z, targets).mean()


def flax_onehot_smoothed(x, w, labels):  # transformers' Flax examples' spelling
    from flax.training.common_utils import onehot

    z = x @ w
    v = z.shape[-1]
    targets = onehot(labels, v, on_value=1.0 - EPS, off_value=EPS / (v - 1))
    return optax.softmax_cross_entropy(z, targets).mean()


def integer_z_loss(x, w, labels):
    z = x @ w
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(z, labels) + _z_loss(z))


def smoothed_z_loss(x, w, labels):
    z = x @ w
    targets = optax.smooth_labels(jax.nn.one_hot(labels, z.shape[-1]), EPS)
    return jnp.mean(optax.softmax_cross_entropy(z, targets) + _z_loss(z))


def capped_integer(x, w, labels):  # Gemma 2's final logit soft cap
    z = CAP * jnp.tanh((x @ w) / CAP)
    return optax.softmax_cross_entropy_with_integer_labels(z, labels).mean()


FORMS = {
    "optax integer labels": optax_integer,
    "optax one_hot": optax_one_hot,
    "optax smooth_labels": optax_smoothed,
    "flax onehot (on/off)": flax_onehot_smoothed,
    "integer + z-loss": integer_z_loss,
    "smooth_labels + z-loss": smoothed_z_loss,
    "soft-capped integer": capped_integer,
}
SIZES = {"full": (4, 1024, 512, 8192), "smoke": (2, 16, 8, 64)}  # B, T, D, V
MiB = 2**20


def data(B, T, D, V):
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (B, T, D))
    w = 0.05 * jax.random.normal(k[1], (D, V))
    return x, w, jax.random.randint(k[2], (B, T), 0, V)


def measure(loss, args, repeats: int) -> dict:
    report = cannjax.inspect.optimize(loss, *args)
    rows = [r for r in report.replaced if r.kind == "loss"]
    plain = jax.jit(jax.value_and_grad(loss, (0, 1)))
    opt = jax.jit(jax.value_and_grad(cannjax.optimize(loss), (0, 1)))
    (lp, gp), (lo, go) = plain(*args), opt(*args)
    err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(go, gp))
    tp, to = interleaved_times([lambda: plain(*args), lambda: opt(*args)], repeats=repeats)
    return {
        "found": [f"{r.op}: {r.source}" for r in rows],
        "loss_rel_err": float(abs(lo - lp) / abs(lp)),
        "grad_rel_err": err,
        "temp_bytes": [temp_bytes(plain, *args), temp_bytes(opt, *args)],
        "residual_bytes": list(report.residual_bytes),
        "times_s": [tp["median_s"], to["median_s"]],
        "iqr_rel": [tp["iqr_rel"], to["iqr_rel"]],
    }


def rows(res: dict) -> list[list[str]]:
    out = []
    for name, r in res.items():
        (tp, to), (mp, mo), (rp, ro) = r["times_s"], r["temp_bytes"], r["residual_bytes"]
        out.append([
            name,
            "<br>".join(r["found"]) or "nothing",
            f"{r['grad_rel_err']:.1e}",
            f"{mp / MiB:.1f} -> {mo / MiB:.1f} ({mo / mp:.2f}x)",
            f"{rp / MiB:.1f} -> {ro / MiB:.1f}",
            f"{tp * 1e3:.0f} -> {to * 1e3:.0f} ms ({to / tp:.2f}x, ±{max(r['iqr_rel']):.0%})",
        ])  # fmt: skip
    return out


HEAD = ["loss", "found as", "grad rel err", "temp MiB", "residuals MiB", "step time"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="5 timed rounds instead of 15")
    size.add_argument("--smoke", action="store_true", help="tiny shapes: checks that it runs")
    a = p.parse_args(argv)
    B, T, D, V = SIZES["smoke" if a.smoke else "full"]
    repeats = 3 if a.smoke else 5 if a.quick else 15
    ceiling = matmul_ceiling(256, 2) if a.smoke else matmul_ceiling()
    args = data(B, T, D, V)
    res = {}
    for name, loss in FORMS.items():
        res[name] = measure(loss, args, repeats)
        print(markdown_table(HEAD, rows({name: res[name]})), flush=True)
    ceiling = max(ceiling, matmul_ceiling(256, 2) if a.smoke else matmul_ceiling())
    command = "PYTHONPATH=. python benchmarks/optimize_losses.py" + (
        " --smoke" if a.smoke else " --quick" if a.quick else ""
    )
    table = (
        f"# cannjax.optimize on loss spellings\n\nCommand: `{command}`; "
        f"{jax.default_backend()}, jax {jax.__version__}. Logits `x @ w`, B={B} T={T} D={D} "
        f"V={V}; step = `jax.value_and_grad` over (x, w), plain against optimized. Times: "
        f"medians of {repeats} interleaved rounds (± the larger IQR/median), shared 2-core "
        f"CPU; matmul ceiling {ceiling:.0f} GFLOP/s (f32 2048^3, best of a measure before "
        "and after). grad rel err: max |g_opt - g| / max |g| over both gradients. Residuals: "
        "what the backward saves (`cannjax.inspect.optimize`).\n\n"
        + markdown_table(HEAD, rows(res))
    )
    payload = {
        "command": command,
        "sizes": {"B": B, "T": T, "D": D, "V": V},
        "repeats": repeats,
        "matmul_ceiling_gflops": ceiling,
        "smoke": a.smoke,
        "forms": res,
    }
    write_results("optimize_losses", payload, table)
    print(table)
    assert all(np.isfinite(r["grad_rel_err"]) for r in res.values())


if __name__ == "__main__":
    main()
