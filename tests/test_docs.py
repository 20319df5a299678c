"""The documentation site: its API pages are current, and it builds without a warning.

``make docs`` builds it with Sphinx into ``build/docs/html``; here it is built into a
temporary folder, and its inventory (``objects.inv``) must hold every public name.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import posixpath
import subprocess
import sys

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
def test_entry_points_are_on_their_api_pages(site, path, page):
    html = (site / "api" / f"{page}.html").read_text()
    assert f'id="{path}"' in html, f"{path} is not on api/{page}.html"
    # Its docstring is rendered there, not only its name.
    doc = importlib.import_module(page).__dict__[path.rpartition(".")[2]].__doc__
    first = doc.strip().splitlines()[0].split("``")[0][:30]
    assert first in html


@pytest.mark.slow
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
    import re

    import cannjax.ops  # noqa: F401  (registers the operators)
    from cannjax._src.core.registry import registry

    # Other tests in this process may have registered operators of their own.
    ours = [s for s in registry().values() if s.fn.__module__.startswith("cannjax._src.ops.")]
    text = (ROOT / "README.md").read_text()
    counts = {int(n) for n in re.findall(r"\| `cannjax\.ops` \| (\d+) operators", text)}
    assert counts == {len(ours)}, (
        f"README.md says {sorted(counts)} operators; cannjax has {len(ours)}"
    )
