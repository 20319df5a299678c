"""The cannjax GPT step with its MLP's gelu recomputed in the backward, or saved.

The baseline saves gelu's output, as the model did before.

Run: ``PYTHONPATH=. python benchmarks/mlp_recompute.py [--quick]``

``cannjax.models.gpt_loss`` runs ``linear(gelu(h), w_2)`` under ``jax.checkpoint``
(``cannjax/_src/models/gpt.py``, ``_mlp_down``): each layer saves ``h`` and the backward
recomputes ``gelu(h)``. The baseline is the same model with that switched off
(``recompute_activation=False``), so each layer saves ``h`` and ``gelu(h)``. Both are the
step of ``benchmarks/gpt.py`` (value and gradient plus Adam, donated state), timed
interleaved in one process after warm-up (medians); memory is the compiled temp size of
the step, and the residuals are those of the loss's backward.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _harness import interleaved_times, markdown_table, write_results  # noqa: E402
from gpt import matmul_ceiling, setup, step_fn, training_loop  # noqa: E402

from cannjax._src.models import gpt  # noqa: E402
from cannjax.inspect import residuals  # noqa: E402

VARIANTS = {"gelu recomputed (the model)": True, "gelu saved": False}


def measure(repeats: int) -> dict:
    cfg, params, tokens, targets, opt, state = setup()
    ops = gpt._cannjax_ops()
    runs, out = [], {}
    for label, flag in VARIANTS.items():
        o = ops._replace(recompute_activation=flag)

        def loss(p, t, y, c, o=o):
            return gpt._loss(o, p, t, y, c, None)

        step = step_fn(loss, cfg, opt)
        compiled = step.lower(params, state, tokens, targets).compile()
        saved = residuals(lambda p, loss=loss: loss(p, tokens, targets, cfg), params)
        out[label] = {
            "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
            "residual_bytes": int(saved.total_bytes),
        }
        runs.append(training_loop(step, params, state, tokens, targets))
    for label, t in zip(VARIANTS, interleaved_times(runs, repeats=repeats, warmup=2)):
        out[label].update(t)
    return {"config": str(cfg), "batch": int(tokens.shape[0]), "variants": out}


def markdown(res: dict) -> str:
    base = res["variants"]["gelu saved"]
    rows = [
        [
            label,
            f"{m['median_s'] * 1e3:.0f}",
            f"{m['iqr_rel'] * 100:.0f}%",
            f"{m['median_s'] / base['median_s']:.2f}",
            f"{m['temp_bytes'] / 2**20:.1f}",
            f"{m['residual_bytes'] / 2**20:.1f}",
        ]
        for label, m in res["variants"].items()
    ]
    head = ["step", "ms", "spread", "time x saved", "temp MiB", "residual MiB"]
    return (
        "# The GPT's MLP: gelu recomputed in the backward or saved\n\n"
        f"Command: `{res['command']}`; medians of {res['repeats']} interleaved rounds after "
        f"warm-up, shared 2-core CPU, matmul ceiling {res['ceiling_gflops']:.0f} GFLOP/s "
        f"(f32 2048^3). {res['config']}, batch {res['batch']}.\n\n" + markdown_table(head, rows)
    )


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="5 rounds instead of 21")
    a = p.parse_args(argv)
    repeats = 5 if a.quick else 21
    res = {
        "command": "PYTHONPATH=. python benchmarks/mlp_recompute.py"
        + (" --quick" if a.quick else ""),
        "repeats": repeats,
        "ceiling_gflops": matmul_ceiling(),
        **measure(repeats),
    }
    md = markdown(res)
    write_results("gpt_mlp_recompute", res, md)
    print(md)
    return res


if __name__ == "__main__":
    main()
