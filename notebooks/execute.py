"""Executes the notebooks in place and stores their outputs in a form that is stable.

Run ``python notebooks/execute.py`` (or ``make notebooks``) after changing a notebook or
what it shows; give paths to run only some. Each notebook runs top to bottom in a fresh
kernel from the repository root; its outputs and plots are stored, and everything that
changes from run to run without meaning anything is left out: execution timestamps, the
kernel's Python version, memory addresses in reprs, the kernel's temporary folder in
source locations. Cell ids are numbered in order.

``tests/test_notebooks.py`` re-executes every notebook and compares its text outputs with
the stored ones through :func:`comparable`: integers and words must match exactly, floats
to 4 significant digits (XLA's reduction order may differ between machines). A cell tagged
``nondeterministic`` (wall-clock timings) is executed but its outputs are not compared;
images are never compared.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import re
import sys

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Outputs of a cell with this tag are stored but not compared (timings).
NONDETERMINISTIC = "nondeterministic"
TIMEOUT = 600
KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}

_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
# IPython's file for a cell: /tmp/ipykernel_<pid>/<hash of the code>.py -> <hash>.py
_KERNEL_DIR = re.compile(r"[^\s'\"(>]*/ipykernel_\d+/")


def _stable(text: str) -> str:
    return _KERNEL_DIR.sub("", _ADDRESS.sub(" at 0x...", text))


_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def execute(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Runs ``nb`` in a fresh python3 kernel from the repository root, in place."""
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, paths)])
    # Hash seeds and thread counts fixed: the same program gives the same text.
    os.environ.setdefault("PYTHONHASHSEED", "0")
    NotebookClient(
        nb,
        timeout=TIMEOUT,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(ROOT)}},
    ).execute()
    return nb


def normalize(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Strips what changes between runs of the same notebook, in place."""
    nb.metadata = nbformat.from_dict(
        {"kernelspec": KERNELSPEC, "language_info": {"name": "python"}}
    )
    nb.nbformat, nb.nbformat_minor = 4, 5
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i:02d}"
        for key in ("execution", "collapsed", "scrolled"):
            cell.metadata.pop(key, None)
        if cell.cell_type != "code":
            continue
        # The kernel splits a cell's printed text into chunks as it pleases: merge them.
        merged = []
        for out in cell.outputs:
            last = merged[-1] if merged else None
            if out.output_type == "stream" and last and last.output_type == "stream":
                if last.name == out.name:
                    last.text += out.text
                    continue
            merged.append(out)
        cell.outputs = merged
        for out in cell.outputs:
            out.get("metadata", {}).pop("execution", None)
            if out.output_type == "stream":
                out.text = _stable(out.text)
            for mime, value in out.get("data", {}).items():
                if mime.startswith("text/") and isinstance(value, str):
                    out.data[mime] = _stable(value)
    return nb


def text_outputs(cell: nbformat.NotebookNode) -> list[str]:
    """The text a reader sees for a code cell: streams, results and their HTML."""
    out = []
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            out.append(f"[{o.name}] {o.text}")
        elif o.output_type in ("execute_result", "display_data"):
            for mime in ("text/plain", "text/html", "text/markdown"):
                if mime in o.get("data", {}) and "image/png" not in o.data:
                    out.append(f"[{mime}] {o.data[mime]}")
        elif o.output_type == "error":
            out.append(f"[error] {o.ename}: {o.evalue}")
    return out


def comparable(text: str) -> tuple[list[str], list[str]]:
    """``text`` split into its words (compared exactly) and its numbers, each rounded.

    Integers stay as they are; a float keeps 4 significant digits; runs of white space
    count as one space.
    """
    text = _stable(text)
    # Runs of spaces collapse: a column's padding follows the width of its numbers.
    words = [re.sub(r"\s+", " ", w).strip() for w in _NUMBER.split(text)]
    numbers = []
    for tok in _NUMBER.findall(text):
        if re.fullmatch(r"[-+]?\d+", tok):
            numbers.append(tok)
        else:
            x = float(tok)
            numbers.append("0" if x == 0 or not math.isfinite(x) else f"{x:.4g}")
    return words, numbers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=pathlib.Path, help="default: all notebooks")
    args = parser.parse_args(argv)
    for path in args.paths or NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        print(f"executing {path.name}", flush=True)
        normalize(execute(nb))
        errors = [t for c in nb.cells for t in text_outputs(c) if t.startswith("[error]")]
        nbformat.write(nb, path)
        if errors:
            print(f"{path.name}: {errors[0]}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
