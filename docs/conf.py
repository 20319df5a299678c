"""Sphinx configuration of the cannjax documentation site.

Build it with ``make docs`` (``sphinx-build -W --keep-going -b html docs build/docs/html``).
The pages are Markdown (MyST); the API pages under ``docs/api/`` are written by
``python docs/gen_api.py`` and hold one autodoc directive per public name. The notebooks
are shown with the outputs stored in them: the site never executes them
(``notebooks/execute.py`` does, and ``make test`` checks that the stored outputs are
current).
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

project = "cannjax"
author = "the cannjax authors"
copyright = "the cannjax authors"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_nb",
]

# Markdown pages and the stored notebook outputs; nothing is executed at build time.
nb_execution_mode = "off"
myst_enable_extensions = ["dollarmath", "colon_fence"]
# Headings down to ### get anchors, so that "page.md#section" links resolve.
myst_heading_anchors = 3

exclude_patterns = ["_build"]

# The notebooks live in notebooks/ at the repository root, outside this source folder:
# copy them (stored outputs and all) to docs/notebooks/ (gitignored) before Sphinx looks
# for sources. Files are rewritten only when they changed, so rebuilds stay incremental.
NOTEBOOKS = ROOT / "docs" / "notebooks"
NOTEBOOKS.mkdir(exist_ok=True)
for _nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
    _dst = NOTEBOOKS / _nb.name
    if not _dst.exists() or _dst.read_bytes() != _nb.read_bytes():
        _dst.write_bytes(_nb.read_bytes())
for _stale in NOTEBOOKS.glob("*.ipynb"):
    if not (ROOT / "notebooks" / _stale.name).exists():
        _stale.unlink()

# Google-style docstrings.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# "Attributes:" sections become fields of their class, not objects of their own: the
# fields of NamedTuples and dataclasses are also documented by autodoc's :members:.
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_class_signature = "separated"

html_theme = "alabaster"
html_title = "cannjax"
html_theme_options = {"page_width": "1100px", "sidebar_width": "260px"}
