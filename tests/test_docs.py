"""The documentation: its code runs and shows what it prints, and the site builds.

Every code block of README.md and docs/*.md runs, and the output its sessions show is
compared (the conventions are above ``PAGES`` below). ``make docs`` builds the site with
Sphinx into ``build/docs/html``; here it is built into a temporary folder, its API pages
must be current and its inventory (``objects.inv``) must hold every public name.
"""

from __future__ import annotations

import collections
import dataclasses
import doctest
import importlib
import importlib.util
import io
import pathlib
import posixpath
import re
import subprocess
import sys
import textwrap
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", DOCS / "gen_api.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


def _public_names() -> list[tuple[str, str]]:
    gen = _gen_api()
    return [(m, n) for m in gen.public_modules()[1:] for n in importlib.import_module(m).__all__]


def test_api_pages_are_current():
    pages = _gen_api().render_pages()
    on_disk = {p.name: p.read_text() for p in (DOCS / "api").glob("*.md")}
    assert set(on_disk) == set(pages), "docs/api/ is stale: run python docs/gen_api.py"
    for name, text in pages.items():
        assert on_disk[name] == text, f"docs/api/{name} is stale: run python docs/gen_api.py"


def test_every_public_name_has_a_directive():
    pages = _gen_api().render_pages()
    for mod, name in _public_names():
        text = pages[f"{mod}.md"]
        assert f":: {mod}.{name}\n" in text or f":: {name}\n   :module: {mod}\n" in text, (
            f"docs/api/{mod}.md does not document {name}"
        )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_nb")
    out = tmp_path_factory.mktemp("docs")
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-E", "-b", "html"]
    cmd += ["-d", str(out / "doctrees"), str(DOCS), str(out / "html")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"sphinx-build failed or warned:\n{proc.stdout}\n{proc.stderr}"
    return out / "html"


def _inventory(site: pathlib.Path) -> dict[str, dict[str, tuple]]:
    from sphinx.util.inventory import InventoryFile

    with open(site / "objects.inv", "rb") as f:
        inv = InventoryFile.load(f, "", posixpath.join)
    # Sphinx >= 8.2 returns an _Inventory object; older ones a plain dict.
    data = getattr(inv, "data", inv)
    return {domain: dict(items) for domain, items in data.items()}


@pytest.mark.slow
@pytest.mark.extended  # long; make test-extended (CI) runs it
def test_site_builds_and_documents_every_public_name(site):
    inv = _inventory(site)
    py = {
        name: item
        for domain, items in inv.items()
        if domain.startswith("py:")
        for name, item in items.items()
    }
    missing = [f"{m}.{n}" for m, n in _public_names() if f"{m}.{n}" not in py]
    assert not missing, f"not on any API page: {missing}"
    for mod, _ in _public_names():
        assert mod in inv["py:module"], f"no API page for module {mod}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "path,page",
    [
        ("cannjax.fusion.fuse", "cannjax.fusion"),
        ("cannjax.remat.checkpointed_scan", "cannjax.remat"),
    ],
)
@pytest.mark.extended  # builds the site (18 s), as the test above does
def test_entry_points_are_on_their_api_pages(site, path, page):
    html = (site / "api" / f"{page}.html").read_text()
    assert f'id="{path}"' in html, f"{path} is not on api/{page}.html"
    # Its docstring is rendered there, not only its name.
    doc = importlib.import_module(page).__dict__[path.rpartition(".")[2]].__doc__
    first = doc.strip().splitlines()[0].split("``")[0][:30]
    assert first in html


@pytest.mark.slow
@pytest.mark.extended  # builds the site (18 s), as the test above does
def test_site_has_the_pages(site):
    for page in ["index", "getting_started", "api", "api/index", "fuse", "remat", "amp"]:
        assert (site / f"{page}.html").exists(), f"{page}.html was not built"
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks
    for nb in notebooks:
        html = (site / "notebooks" / f"{nb.stem}.html").read_text()
        # The stored outputs are shown: each notebook has at least one plot.
        assert "data:image/png" in html or ".png" in html, f"{nb.stem}.html shows no plot"
    index = (site / "index.html").read_text()
    for nb in notebooks:
        assert f"notebooks/{nb.stem}.html" in index


def test_readme_counts_the_registered_operators():
    import cannjax.ops  # noqa: F401  (registers the operators)
    from cannjax._src.core.registry import registry

    # Other tests in this process may have registered operators of their own.
    ours = [s for s in registry().values() if s.fn.__module__.startswith("cannjax._src.ops.")]
    text = (ROOT / "README.md").read_text()
    counts = {int(n) for n in re.findall(r"\| `cannjax\.ops` \| (\d+) operators", text)}
    assert counts == {len(ours)}, (
        f"README.md says {sorted(counts)} operators; cannjax has {len(ours)}"
    )


# --------------------------------------------------------------- the pages' code blocks
# Every fenced block of README.md and docs/*.md (not docs/api/, which gen_api.py writes)
# is one of these, by its fence:
#
# - ```python: code. It runs: a page's blocks in order, in one namespace, as a reader
#   pastes them one after the other. A comment in it is prose; output is never shown in
#   a comment (test_python_blocks_show_no_output_in_comments rejects "# [1., 0.]").
# - ```pycon: a Python session, ">>> " and "... " prompts with the output each line
#   prints, in the same namespace. It runs and doctest compares the output (ELLIPSIS:
#   "..." matches anything, as "0.867..." or a source line; NORMALIZE_WHITESPACE), so a
#   changed value fails the test.
# - any other fence (sh, bash, text, none, {toctree}): not Python, not run.
#
# A python or pycon block right after a line `<!-- not run: REASON -->` is shown but
# not run: a signature, a fragment of the block above it, or code for several processes,
# an Ascend device or a multi-host cluster. The summary line of the run ("docs code
# blocks: ...", conftest.py) counts the blocks run, checked and not run.
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
NOT_RUN = re.compile(r"^<!-- not run: (.+?) -->$")
FENCE = re.compile(r"^(\s*)(`{3,})\s*(\S*)")
# Pages whose blocks take long (compiling flax, equinox and sharded models): make
# test-extended runs them.
LONG = {"optimize.md": "three models compiled twice each (~1 min)"}


@dataclasses.dataclass(frozen=True)
class Block:
    """A fenced block of a page."""

    page: pathlib.Path
    line: int  # the line of its first code line, counted from 1
    lang: str
    source: str
    not_run: str | None  # the reason, for a python or pycon block marked not run

    @property
    def runs(self) -> bool:
        return self.lang in ("python", "pycon") and self.not_run is None


def blocks(page: pathlib.Path) -> list[Block]:
    """The fenced blocks of ``page``, in order."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, lang = m.groups()
        end = i + 1
        while not re.match(rf"^\s*{ticks}\s*$", lines[end]):
            end += 1
        body = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
        marker = NOT_RUN.match(lines[i - 1].strip()) if i else None
        out.append(Block(page, i + 2, lang, body, marker and marker.group(1)))
        i = end + 1
    return out


def run_page(page: pathlib.Path) -> tuple[dict, collections.Counter]:
    """Runs the python and pycon blocks of ``page``: ``(namespace, counts by kind)``."""
    namespace = {"__name__": f"docs_{page.stem}"}
    counts = collections.Counter()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    for block in blocks(page):
        where = f"{page.relative_to(ROOT)}:{block.line}"
        if not block.runs:
            continue
        if block.lang == "python":
            # Blank lines first, so that a traceback names the line of the page.
            code = compile("\n" * (block.line - 1) + block.source, str(page), "exec")
            try:
                exec(code, namespace)
            except Exception as e:
                raise AssertionError(f"the python block at {where} failed: {e!r}") from e
            counts["run"] += 1
            continue
        test = doctest.DocTestParser().get_doctest(
            block.source, namespace, where, str(page), block.line - 1
        )
        report = io.StringIO()
        runner = doctest.DocTestRunner(optionflags=flags)
        result = runner.run(test, out=report.write, clear_globs=False)
        namespace.update(test.globs)
        assert result.failed == 0, f"the pycon block at {where}:\n{report.getvalue()}"
        counts["run"] += 1
        counts["checked"] += 1
    return namespace, counts


def _page_params():
    for page in PAGES:
        if not any(b.runs for b in blocks(page)):
            continue
        marks = [pytest.mark.extended] if page.name in LONG else []
        yield pytest.param(page, id=page.name, marks=marks)


@pytest.fixture
def docs_session(tmp_path, monkeypatch):
    """A reader's session: a fresh folder, plots off screen, jax's default rank promotion.

    The suite raises on implicit rank promotion (tests/conftest.py); a reader's
    ``x @ w + b`` with ``b`` of shape ``[D]`` is ordinary JAX and runs here as for them.
    """
    import jax

    monkeypatch.chdir(tmp_path)
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        pass
    with jax.numpy_rank_promotion("allow"):
        yield
    try:
        import matplotlib.pyplot as plt

        plt.close("all")
    except ImportError:
        pass


@pytest.mark.parametrize("page", list(_page_params()))
def test_code_blocks_run_and_show_their_output(page, docs_session, record_property):
    _, counts = run_page(page)
    assert counts["run"] > 0
    record_property("docs code blocks", dict(counts))


def test_blocks_not_run_are_marked_with_a_reason(record_property):
    # The blocks left out of the runs are the ones marked, each with its reason.
    not_run = 0
    for page in PAGES:
        for b in blocks(page):
            not_run += b.not_run is not None
            where = f"{page.relative_to(ROOT)}:{b.line}"
            if b.not_run is not None:
                assert b.lang in ("python", "pycon"), f"{where}: only python blocks are marked"
                assert len(b.not_run) > 10, f"{where}: say why it does not run"
            if b.lang in ("py", "python3", "ipython", "py3"):
                raise AssertionError(f"{where}: fence it as python or pycon, got {b.lang!r}")
    record_property("docs code blocks", {"not run": not_run})


# A comment that shows a value: "# [1., 0., 0.867...]", "# {'norm': 2}", "# -> 3".
SHOWN = re.compile(r"^#\s*(->|=>|Array\(|\[\s*[-+]?(\d|nan|inf)|\{\s*['\"]|[-+]?\d[\d.e+-]*$)")


def test_python_blocks_show_no_output_in_comments():
    for page in PAGES:
        for b in blocks(page):
            if b.lang != "python":
                continue
            tokens = tokenize.generate_tokens(io.StringIO(b.source).readline)
            for t in tokens:
                if t.type == tokenize.COMMENT and SHOWN.match(t.string):
                    where = f"{page.relative_to(ROOT)}:{b.line + t.start[0] - 1}"
                    raise AssertionError(
                        f"{where}: {t.string!r} shows output in a comment, where no test "
                        "checks it: write the lines as a pycon block (>>> prompts, the output "
                        "below them), which tests/test_docs.py compares"
                    )


def _signatures(source: str) -> list[tuple[str, str]]:
    """``[(name, "(params)")]`` of a block of signatures such as ``f(x, *, axis=-1)``."""
    return re.findall(r"^(\w+)(\(.*?\))\s*$", source, re.M | re.S)


def test_signature_blocks_match_the_functions():
    # The blocks marked "a signature" are not run; what they state is checked here: the
    # names, kinds and defaults of cannjax.ops' parameters.
    import inspect

    import jax.numpy as jnp

    import cannjax.ops

    checked = 0
    for page in PAGES:
        for b in blocks(page):
            if b.not_run != "a signature":
                continue
            found = _signatures(b.source)
            assert found, f"{page.relative_to(ROOT)}:{b.line}: no signature in the block"
            for name, params in found:
                namespace = {"jnp": jnp}
                exec(f"def {name}{params}: pass", namespace)
                shown = inspect.signature(namespace[name]).parameters.values()
                real = inspect.signature(getattr(cannjax.ops, name)).parameters.values()
                assert [(p.name, p.kind, p.default) for p in shown] == [
                    (p.name, p.kind, p.default) for p in real
                ], f"{page.relative_to(ROOT)}:{b.line}: {name}{params}"
                checked += 1
    assert checked >= 10
