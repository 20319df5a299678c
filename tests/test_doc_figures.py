"""Every measured figure of the docs comes from a committed result in benchmarks/results/.

``benchmarks/_doc_figures.py`` ties each figure to its source: tables written from the
results' JSON between markers, quotes filled from them, and the few figures that are no
measurement. Nothing here runs a benchmark: the checks read files only.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


figures = _load("_doc_figures")


def test_generated_tables_equal_what_the_results_give():
    assert figures.table_problems() == []


def test_quoted_figures_match_their_results_and_name_them():
    assert figures.quote_problems() == []


def test_every_figure_of_the_docs_has_a_source():
    assert list(figures.unsourced_figures()) == []


def test_exemptions_are_still_in_their_docs():
    assert figures.stale_exemptions() == []


def test_benchmarks_readme_is_assembled_from_the_results():
    readme = _load("_readme")
    assert (BENCH / "README.md").read_text() == readme.assemble(), (
        "benchmarks/README.md is stale: run python benchmarks/_readme.py"
    )


# ------------------------------------------------------- the checks fail when they should
@pytest.fixture
def results(tmp_path) -> pathlib.Path:
    """A copy of the committed results, to record a 'new run' in."""
    out = tmp_path / "results"
    shutil.copytree(figures.RESULTS, out)
    return out


@pytest.fixture
def root(tmp_path) -> pathlib.Path:
    """A copy of the pages the checks read (docs/*.md, README.md)."""
    out = tmp_path / "root"
    (out / "docs").mkdir(parents=True)
    for page in figures.doc_paths():
        shutil.copy(page, out / page.relative_to(ROOT))
    return out


def _edit_json(path: pathlib.Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_a_result_recorded_again_without_its_docs_fails(results):
    def faster(res):
        res["times_s"]["cannjax"] = 0.300

    _edit_json(results / "gpt.json", faster)
    tables = figures.table_problems(results)
    assert any("table 'gpt'" in p for p in tables), tables
    quotes = figures.quote_problems(results)
    # The quote that gives the time comes back as it now reads.
    t = json.loads((results / "gpt.json").read_text())["times_s"]
    need = f"these need {t['plain JAX'] * 500:.0f} ms and {t['PyTorch eager'] * 1e3 / 1.2:.0f} ms"
    assert any(f"{need}; cannjax takes 300 ms" in p for p in quotes), quotes


def test_a_statement_the_result_no_longer_supports_fails(results):
    def within_target(res):
        res["paired_ratio_median"] = 1.01

    _edit_json(results / "health.json", within_target)
    found = figures.quote_problems(results)
    assert any("both measures of the overhead miss the 5% target" in p for p in found), found


def test_a_quote_whose_paragraph_does_not_name_its_result_fails(root):
    page = root / "docs" / "health.md"
    page.write_text(page.read_text().replace("(`benchmarks/results/health.md`, 30", "(30"))
    found = figures.quote_problems(root=root)
    assert any("cites no ['results/health.']" in p for p in found), found


def test_a_figure_without_a_source_is_found(root):
    page = root / "docs" / "remat.md"
    page.write_text(page.read_text() + "\nThe planner takes 12.5 ms and 3.2x less memory.\n")
    found = list(figures.unsourced_figures(root=root))
    assert [f.split(" in: ")[0] for f in found] == [
        "docs/remat.md: '12.5 ms'",
        "docs/remat.md: '3.2x'",
    ]


def test_writing_the_tables_fills_them_from_the_results(root):
    page = root / "docs" / "remat.md"
    block = next(b for b in figures.BLOCKS if b.name == "remat")
    page.write_text(block.rewrite(page.read_text(), "| stale |"))
    assert any("table 'remat'" in p for p in figures.table_problems(root=root))
    assert set(figures.write_tables(root=root)) == {"docs/remat.md"}
    assert figures.table_problems(root=root) == []


def test_paragraphs_keep_a_list_with_the_sentence_that_introduces_it():
    text = "Measured (`results/a.md`):\n\n- one 1 ms\n- two\n\nNext.\n\n- alone\n"
    assert figures.chunks(text) == [
        "Measured (`results/a.md`): - one 1 ms - two",
        "Next.",
        "- alone",
    ]


def test_code_is_not_prose():
    text = "Run it:\n\n```\nsleep 5 s\n```\n\nWith `--limit 3 s` it stops.\n"
    assert figures.chunks(text) == ["Run it:", "With `--limit 3 s` it stops."]
    assert not list(figures.FIGURE.finditer(figures._CODE.sub(" ", figures.chunks(text)[1])))
