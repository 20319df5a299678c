"""Every notebook in notebooks/ is stored executed, and a fresh run gives the same text.

``notebooks/execute.py`` (``make notebooks``) executes them in place; here each one is
re-executed in a fresh kernel and must raise nothing, show a plot, and print what its
stored outputs say (words and integers exactly, floats to 4 significant digits), except in
cells tagged ``nondeterministic`` (wall-clock timings).
"""

import copy
import importlib.util
import os
import pathlib

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

_spec = importlib.util.spec_from_file_location("execute", ROOT / "notebooks" / "execute.py")
execute = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute)


def _code(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 6


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_executed_and_normalized(path):
    nb = nbformat.read(path, as_version=4)
    cells = _code(nb)
    assert [c.execution_count for c in cells] == list(range(1, len(cells) + 1)), (
        f"{path.name} is not stored executed top to bottom: run python notebooks/execute.py"
    )
    assert any(c.outputs for c in cells), f"{path.name} is stored without outputs"
    stored = nbformat.writes(nb)
    assert nbformat.writes(execute.normalize(copy.deepcopy(nb))) == stored, (
        f"{path.name} holds run-specific metadata: run python notebooks/execute.py"
    )
    md = [c for c in nb.cells if c.cell_type == "markdown"]
    assert len(md) >= len(cells) // 2, f"{path.name}: explain the code cells in markdown"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_matches_its_stored_outputs(path, monkeypatch):
    # The kernel compiles as the user's JAX does, not with the suite's cheap codegen
    # (conftest.py): the stored outputs are what a user sees.
    monkeypatch.setenv("XLA_FLAGS", os.environ["CANNJAX_TEST_USER_XLA_FLAGS"])
    stored = nbformat.read(path, as_version=4)
    nb = copy.deepcopy(stored)
    for cell in _code(nb):
        cell.outputs, cell.execution_count = [], None
    execute.normalize(execute.execute(nb))
    errors = [t for c in _code(nb) for t in execute.text_outputs(c) if t.startswith("[error]")]
    assert not errors, f"{path.name}: {errors}"
    images = [o for c in _code(nb) for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, f"{path.name} shows no plot"
    for i, (old, new) in enumerate(zip(_code(stored), _code(nb))):
        if execute.NONDETERMINISTIC in old.metadata.get("tags", []):
            continue
        want = [execute.comparable(t) for t in execute.text_outputs(old)]
        got = [execute.comparable(t) for t in execute.text_outputs(new)]
        assert got == want, (
            f"{path.name}, code cell {i + 1}: the output differs from the stored one "
            f"(run python notebooks/execute.py if the change is intended)\n"
            f"stored: {execute.text_outputs(old)}\nnow:    {execute.text_outputs(new)}"
        )
