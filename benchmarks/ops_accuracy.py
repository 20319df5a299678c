"""Accuracy of every operator: largest relative error against a 50-digit truth.

For every registered op (each configuration: gelu's two forms, softmax with ``where``,
...) and for float32 and float64, ``cannjax.testing.measure_accuracy(op, dtype,
points="benchmark")`` sweeps the op's domain (tails included), computes the truth with
mpmath at 50 digits and reports the largest ``|got - true| / max(|true|, floor)`` of
cannjax and of its counterpart (jax.nn, jax.scipy.special, jnp or optax), in ulps of the
dtype, with the worst input; for elementwise ops also the first derivative's. The
measure and the floor are described in ``docs/ops_accuracy.md``. The sweep is
deterministic, so the figures do not depend on the machine's load.

Run: ``PYTHONPATH=. python benchmarks/ops_accuracy.py [--docs]``. Writes
``ops_accuracy.json`` and ``.md`` to the results folder (``build/bench/results/``, or
``benchmarks/results/`` under ``cannjax bench --write``: see ``benchmarks/_harness.py``);
``--docs`` also replaces the table in ``docs/ops_accuracy.md``.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _harness import markdown_table, write_results  # noqa: E402

from cannjax.core import registry  # noqa: E402
from cannjax.testing import measure_accuracy  # noqa: E402

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "ops_accuracy.md"
START, END = "<!-- ops_accuracy table: start -->", "<!-- ops_accuracy table: end -->"
COMMAND = "PYTHONPATH=. python benchmarks/ops_accuracy.py"


def _ulps(r):
    if r is None:
        return "-"
    u = r["ulps"]
    if math.isinf(u):
        return "inf"
    return f"{u:.3g}" if u < 1e4 else f"{u:.2e}"


def _worst(r):
    w = r["worst_input"]
    if isinstance(w, float):
        return f"{w:.6g}"
    if isinstance(w, list | tuple):
        return "(" + ", ".join(f"{v:.4g}" for v in w) + ")"
    return str(w).split(":")[0]  # "row k" of the row-wise sweeps


def table(rows) -> str:
    """The markdown table of ``rows`` (results of ``measure_accuracy``)."""
    headers = [
        "op",
        "dtype",
        "points",
        "cannjax ulps",
        "worst input",
        "counterpart",
        "counterpart ulps",
        "d/dx cannjax ulps",
        "d/dx counterpart ulps",
    ]
    body = []
    for r in rows:
        body.append(
            [
                f"`{r['op']}`",
                r["dtype"],
                r["points"],
                _ulps(r["cannjax"]),
                _worst(r["cannjax"]),
                f"`{r['counterpart_name']}`" if r["counterpart_name"] else "none",
                _ulps(r.get("counterpart")),
                _ulps(r.get("cannjax_derivative")),
                _ulps(r.get("counterpart_derivative")),
            ]
        )
    return markdown_table(headers, body)


def _update_docs(md: str) -> None:
    text = DOCS.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    DOCS.write_text(f"{head}{START}\n{md.strip()}\n{END}{tail}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", action="store_true", help="update docs/ops_accuracy.md")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("ops", nargs="*", help="registered op names (default: all)")
    a = parser.parse_args(argv)
    rows = []
    for name in a.ops or sorted(registry()):
        for dtype in ("float32", "float64"):
            t0 = time.perf_counter()
            for r in measure_accuracy(name, dtype, points="benchmark"):
                rows.append(r)
                print(
                    f"{r['op']:26s} {dtype}  cannjax {_ulps(r['cannjax']):>9s} ulps  "
                    f"counterpart {_ulps(r.get('counterpart')):>9s}  "
                    f"({time.perf_counter() - t0:.1f}s)",
                    flush=True,
                )
    rows.sort(key=lambda r: (r["op"], r["dtype"]))
    md = (
        f"Command: `{COMMAND}`. Largest relative error over each op's sweep, in ulps "
        "of the dtype (eps = 2^-23 / 2^-52; correctly rounded is 0.5), against a "
        "50-digit mpmath truth; floor and sweeps: docs/ops_accuracy.md.\n\n" + table(rows)
    )
    if not a.no_write:
        write_results("ops_accuracy", {"command": COMMAND, "rows": rows}, md)
        if a.docs:
            _update_docs(md)
    return rows


if __name__ == "__main__":
    main()
