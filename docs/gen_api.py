"""Writes docs/api.md: every public name of cannjax at its one address, with its summary.

Run ``python docs/gen_api.py`` after changing the public surface; ``tests/test_public_api.py``
fails while docs/api.md is out of date.
"""

from __future__ import annotations

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
        out.append(f"## `{m}`\n\n{first}\n")
        out += [f"* `{m}.{n}`: {summary(getattr(mod, n), f'{m}.{n}')}" for n in mod.__all__]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    path = pathlib.Path(__file__).with_name("api.md")
    path.write_text(render())
    sys.stdout.write(f"wrote {path}\n")
