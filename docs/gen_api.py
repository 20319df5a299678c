"""Writes docs/api.md and docs/api/<module>.md: every public name of cannjax, at its address.

docs/api.md lists each public name with the first line of its docstring; docs/api/ holds
one page per public module with an autodoc directive per name (the reference pages of the
site, ``make docs``). Run ``python docs/gen_api.py`` after changing the public surface;
``tests/test_public_api.py`` fails while docs/api.md is out of date and
``tests/test_docs.py`` while a page of docs/api/ is.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import pkgutil
import sys

CONSTANTS = {
    "cannjax.fusion.LEVELS": "the fusion levels `fuse(level=...)` accepts",
    "cannjax.remat.SCHEDULES": "the schedules `checkpointed_scan(schedule=...)` accepts",
    "cannjax.remat.policies.STATISTICS": "residual keys that hold per-row statistics",
    "cannjax.parallel.DEFAULT_BUCKET_BYTES": "default gradient bucket size in bytes",
    "cannjax.backend.OVERFLOW_MODES": "the overflow modes a platform can have",
    "cannjax.backend.ascend.DEFAULT_TARGETS": "the operators the Ascend table covers by default",
    "cannjax.backend.ascend.KERNELS_ENV": "environment variable that selects Ascend kernels",
    "cannjax.backend.ascend.TARGET_SIGNATURES": "the signature each Ascend target must have",
}

HEADER = """# API reference

Every public object of cannjax has one address, in the module of its feature; this page
lists them all with the first line of their docstring (`help(obj)` has the rest). It is
written by `python docs/gen_api.py` and checked by `tests/test_public_api.py`.

## Top-level aliases

The top-level `cannjax` re-exports only the entry points of the README's first example:

{aliases}
"""


def public_modules() -> list[str]:
    import cannjax

    names = ["cannjax"] + [
        m.name
        for m in pkgutil.walk_packages(cannjax.__path__, "cannjax.")
        if "._" not in m.name and m.name != "cannjax.__main__"
    ]
    return sorted(names)


def summary(obj, path: str) -> str:
    if path in CONSTANTS:
        return CONSTANTS[path]
    doc = inspect.getdoc(obj) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def render() -> str:
    mods = public_modules()
    import cannjax

    where = {}
    for m in mods[1:]:
        mod = importlib.import_module(m)
        for n in mod.__all__:
            where.setdefault(id(getattr(mod, n)), f"{m}.{n}")
    aliases = "\n".join(
        f"* `cannjax.{n}` is `{where[id(getattr(cannjax, n))]}`" for n in cannjax.__all__
    )
    out = [HEADER.format(aliases=aliases)]
    for m in mods[1:]:
        mod = importlib.import_module(m)
        first = (inspect.getdoc(mod) or "").strip().split("\n\n")[0].replace("\n", " ")
        out.append(f"## [`{m}`](api/{m}.md)\n\n{first}\n")
        out += [f"* `{m}.{n}`: {summary(getattr(mod, n), f'{m}.{n}')}" for n in mod.__all__]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _directive(mod: str, name: str) -> str:
    """The autodoc directive that documents ``mod.name`` on its module's page."""
    obj = getattr(importlib.import_module(mod), name)
    path = f"{mod}.{name}"
    if inspect.isclass(obj):
        kind = "autoexception" if issubclass(obj, BaseException) else "autoclass"
        return f".. {kind}:: {path}\n   :members:\n"
    if inspect.isroutine(inspect.unwrap(obj)):  # functions, also under functools wrappers
        return f".. autofunction:: {path}\n"
    # Constants and callable instances (policies): described by the ``#:`` comment above
    # their definition in cannjax._src (autodoc reads such comments only in the module it
    # imports, the re-exporting one), else by CONSTANTS; constants show their value.
    lines = _doc_comment(mod, name)
    if not lines and path in CONSTANTS:
        what = CONSTANTS[path].replace("`", "``")  # Markdown code -> reStructuredText
        lines = [f"{what[0].upper()}{what[1:]}."]
    text = f".. py:data:: {name}\n   :module: {mod}\n"
    if not callable(obj) and len(repr(obj)) <= 100:
        text += f"   :value: {obj!r}\n"
    elif not callable(obj):
        text += f"   :type: {type(obj).__name__}\n"
    body = "\n".join(f"   {line}" if line else "" for line in lines)
    return text + (f"\n{body}\n" if lines else "")


def _doc_comment(mod: str, name: str) -> list[str]:
    """The ``#:`` comment lines above the definition of ``name`` re-exported by ``mod``."""
    public = pathlib.Path(importlib.import_module(mod).__file__)
    src = next(
        node.module
        for node in ast.parse(public.read_text()).body
        if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names)
    )
    source = pathlib.Path(importlib.import_module(src).__file__).read_text().splitlines()
    for node in ast.parse("\n".join(source)).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            i = node.lineno - 2
            out = []
            while i >= 0 and source[i].lstrip().startswith("#:"):
                out.insert(0, source[i].lstrip()[2:].strip())
                i -= 1
            return out
    return []


def render_pages() -> dict[str, str]:
    """The API pages: ``{"cannjax.amp.md": text, ...}`` and their index ``index.md``."""
    mods = public_modules()[1:]
    pages = {}
    for m in mods:
        mod = importlib.import_module(m)
        body = "\n".join(_directive(m, n) for n in mod.__all__)
        pages[f"{m}.md"] = (
            f"# `{m}`\n\n"
            f"<!-- Written by python docs/gen_api.py; do not edit. -->\n\n"
            f"```{{eval-rst}}\n.. automodule:: {m}\n   :no-members:\n\n{body}```\n"
        )
    toc = "\n".join(mods)
    pages["index.md"] = (
        "# API pages\n\n"
        "One page per public module, each name with its full docstring. The summary of\n"
        "all names on one page is the [API reference](../api.md).\n\n"
        f"```{{toctree}}\n:maxdepth: 1\n\n{toc}\n```\n"
    )
    return pages


if __name__ == "__main__":
    path = pathlib.Path(__file__).with_name("api.md")
    path.write_text(render())
    sys.stdout.write(f"wrote {path}\n")
    pages = path.with_name("api")
    pages.mkdir(exist_ok=True)
    for stale in set(pages.glob("*.md")) - {pages / n for n in render_pages()}:
        stale.unlink()
    for name, text in render_pages().items():
        (pages / name).write_text(text)
    sys.stdout.write(f"wrote {pages}/ ({len(render_pages())} pages)\n")
