"""Norms and activations recomputed in the backward, or saved: GPT and Llama steps.

Run: ``PYTHONPATH=. python benchmarks/recompute.py [--quick]``

``cannjax.models`` runs each norm with the projection that reads it, and the GPT's
``gelu`` with its second MLP matmul, under ``jax.checkpoint``
(``cannjax/_src/models/recompute.py``, policy ``save_operator_residuals``): a layer
saves the residual stream and ``h`` once and the backward recomputes ``ln(x)`` and
``gelu(h)``. The baselines are the same models
with that switched off (``recompute_norm=False``, ``recompute_activation=False``), so a
layer also saves each norm's output (and ``gelu(h)``). All are the step of
``benchmarks/gpt.py`` (value and gradient plus Adam, donated state), timed interleaved in
one process after warm-up (medians); memory is the compiled temp size of the step, and
the residuals are those of the loss's backward.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _harness import interleaved_times, markdown_table, write_results  # noqa: E402
from gpt import matmul_ceiling, setup, step_fn, training_loop  # noqa: E402

from cannjax._src.models import gpt, llama  # noqa: E402
from cannjax.inspect import residuals  # noqa: E402

BASELINE = {"gpt": "all saved", "llama": "norms saved"}
VARIANTS = {  # model: {label: _Ops fields}
    "gpt": {
        "norms and gelu recomputed (the model)": {},
        "gelu recomputed, norms saved": {"recompute_norm": False},
        "all saved": {"recompute_norm": False, "recompute_activation": False},
    },
    "llama": {"norms recomputed (the model)": {}, "norms saved": {"recompute_norm": False}},
}
LLAMA = llama.LlamaConfig(
    vocab=1024, width=256, heads=8, kv_heads=2, layers=4, seq_len=256, hidden=704
)


def measure(repeats: int) -> dict:
    gpt_cfg, gpt_params, tokens, targets, opt, _ = setup()  # benchmarks/gpt.py's sizes
    models = {  # model: (module, cfg, params)
        "gpt": (gpt, gpt_cfg, gpt_params),
        "llama": (llama, LLAMA, llama.init_llama(jax.random.key(0), LLAMA)),
    }
    runs, out = [], {}
    for model, (module, cfg, params) in models.items():
        state = opt.init(params)
        for label, fields in VARIANTS[model].items():
            o = module._cannjax_ops()._replace(**fields)

            def loss(p, t, y, c, o=o, module=module):
                return module._loss(o, p, t, y, c, None)

            step = step_fn(loss, cfg, opt)
            compiled = step.lower(params, state, tokens, targets).compile()
            saved = residuals(lambda p, loss=loss, c=cfg: loss(p, tokens, targets, c), params)
            grads = jax.jit(jax.grad(loss), static_argnums=3)(params, tokens, targets, cfg)
            out[(model, label)] = {
                "model": model,
                "variant": label,
                "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
                "residual_bytes": int(saved.total_bytes),
                "grads": grads,
            }
            runs.append(training_loop(step, params, state, tokens, targets))
    for key, t in zip(out, interleaved_times(runs, repeats=repeats, warmup=2)):
        out[key].update(t)
    for (model, _), m in out.items():  # the recomputation repeats the same operations
        base = out[(model, BASELINE[model])]["grads"]
        m["grads_equal_baseline"] = all(
            bool(jnp.array_equal(a, b))
            for a, b in zip(jax.tree.leaves(m["grads"]), jax.tree.leaves(base))
        )
    for m in out.values():
        del m["grads"]
    return {
        "configs": {"gpt": str(gpt_cfg), "llama": str(LLAMA)},
        "batch": int(tokens.shape[0]),
        "variants": list(out.values()),
    }


def markdown(res: dict) -> str:
    base = {m["model"]: m for m in res["variants"] if m["variant"] == BASELINE[m["model"]]}
    rows = [
        [
            m["model"],
            m["variant"],
            f"{m['median_s'] * 1e3:.0f}",
            f"{m['iqr_rel'] * 100:.0f}%",
            f"{m['median_s'] / base[m['model']]['median_s']:.2f}",
            f"{m['temp_bytes'] / 2**20:.1f}",
            f"{m['residual_bytes'] / 2**20:.1f}",
            "yes" if m["grads_equal_baseline"] else "no",
        ]
        for m in res["variants"]
    ]
    head = ["model", "step", "ms", "spread", "time x saved", "temp MiB", "residual MiB",
            "grads bit for bit"]  # fmt: skip
    return (
        "# Norms and activations recomputed in the backward, or saved\n\n"
        f"Command: `{res['command']}`; medians of {res['repeats']} interleaved rounds after "
        f"warm-up, shared 2-core CPU, matmul ceiling {res['ceiling_gflops']:.0f} GFLOP/s "
        f"(f32 2048^3). {res['configs']['gpt']}; {res['configs']['llama']}; batch "
        f'{res["batch"]}. "time x saved" is against the model\'s last row.\n\n'
        + markdown_table(head, rows)
    )


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="5 rounds instead of 21")
    a = p.parse_args(argv)
    repeats = 5 if a.quick else 21
    res = {
        "command": "PYTHONPATH=. python benchmarks/recompute.py" + (" --quick" if a.quick else ""),
        "repeats": repeats,
        "ceiling_gflops": matmul_ceiling(),
        **measure(repeats),
    }
    md = markdown(res)
    write_results("recompute", res, md)
    print(md)
    return res


if __name__ == "__main__":
    main()
