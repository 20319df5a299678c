"""The public surface: one address per object, no module shadowed, nothing undocumented.

The public modules are every module of the ``cannjax`` package outside ``cannjax._src``
(and ``cannjax.__main__``). Each only re-exports; the top-level ``cannjax`` holds at most 8
aliases, each listed in ``docs/api.md`` beside its canonical path.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pathlib
import pkgutil
import types

import pytest

import cannjax

ROOT = pathlib.Path(cannjax.__file__).parent
API_DOC = ROOT.parent / "docs" / "api.md"
MAX_ALIASES = 8


def _all_modules(include_private: bool) -> list[str]:
    names = ["cannjax"]
    for info in pkgutil.walk_packages(cannjax.__path__, "cannjax."):
        if info.name == "cannjax.__main__":
            continue
        if not include_private and "._" in info.name:
            continue
        names.append(info.name)
    return sorted(names)


PUBLIC = _all_modules(include_private=False)
ALL_PACKAGES = [
    m for m in _all_modules(include_private=True) if hasattr(importlib.import_module(m), "__path__")
]


def _imports(mod_name: str) -> list[tuple[str, str, str]]:
    """(source module, name, bound name) of every ``from M import n as b`` in a module."""
    path = pathlib.Path(importlib.import_module(mod_name).__file__)
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            out += [(node.module, a.name, a.asname or a.name) for a in node.names]
    return out


def _canonical() -> dict[str, list[str]]:
    """Object key -> the public paths that export it (top-level aliases aside)."""
    paths: dict[object, list[str]] = {}
    for mod_name in PUBLIC:
        if mod_name == "cannjax":
            continue
        mod = importlib.import_module(mod_name)
        for name in mod.__all__:
            obj = getattr(mod, name)
            # Functions and classes by identity; constants by where they are defined.
            key = (
                id(obj)
                if callable(obj)
                else next((src, n) for src, n, b in _imports(mod_name) if b == name)
            )
            paths.setdefault(key, []).append(f"{mod_name}.{name}")
    return paths


def test_the_public_modules_are_the_features():
    assert PUBLIC == sorted(
        [
            "cannjax",
            "cannjax.amp",
            "cannjax.backend",
            "cannjax.backend.ascend",
            "cannjax.core",
            "cannjax.dynamic",
            "cannjax.fusion",
            "cannjax.health",
            "cannjax.inspect",
            "cannjax.models",
            "cannjax.ops",
            "cannjax.optimization",
            "cannjax.parallel",
            "cannjax.remat",
            "cannjax.remat.policies",
            "cannjax.remat.revolve",
            "cannjax.testing",
        ]
    )


@pytest.mark.parametrize("mod_name", PUBLIC)
def test_public_module_only_reexports(mod_name):
    path = pathlib.Path(importlib.import_module(mod_name).__file__)
    for node in ast.parse(path.read_text()).body:
        reexport = isinstance(node, ast.ImportFrom) and all(
            a.asname in (None, a.name) for a in node.names
        )
        docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        dunder = isinstance(node, ast.Assign) and node.targets[0].id in ("__all__", "__version__")
        assert reexport or docstring or dunder, f"{path}: line {node.lineno} is not a re-export"


@pytest.mark.parametrize("mod_name", PUBLIC)
def test_all_lists_each_public_name_once(mod_name):
    mod = importlib.import_module(mod_name)
    assert len(mod.__all__) == len(set(mod.__all__)), f"{mod_name}.__all__ has a duplicate"
    bound = {b for _, _, b in _imports(mod_name)}
    submodules = {b for b in bound if isinstance(getattr(mod, b), types.ModuleType)}
    assert set(mod.__all__) == bound - submodules, (
        f"{mod_name}: names bound but not in __all__, or listed but not bound: "
        f"{sorted(set(mod.__all__) ^ (bound - submodules))}"
    )


def test_every_public_object_has_one_address():
    seconds = {k: v for k, v in _canonical().items() if len(v) > 1}
    assert not seconds, f"reachable by more than one public path: {sorted(seconds.values())}"


def test_every_public_object_lives_in_src():
    for mod_name in PUBLIC:
        for src, name, _ in _imports(mod_name):
            if isinstance(getattr(importlib.import_module(mod_name), name, None), types.ModuleType):
                continue
            assert src.startswith("cannjax._src.") or mod_name == "cannjax", (
                f"{mod_name}.{name} is re-exported from {src}, not from cannjax._src"
            )


def test_top_level_holds_only_documented_aliases():
    aliases = cannjax.__all__
    assert len(aliases) <= MAX_ALIASES
    canonical = {
        id(getattr(importlib.import_module(p.rpartition(".")[0]), p.rpartition(".")[2])): p
        for paths in _canonical().values()
        for p in paths
    }
    api = API_DOC.read_text()
    for name in aliases:
        obj = getattr(cannjax, name)
        assert id(obj) in canonical, f"cannjax.{name} is not an alias of a public object"
        line = f"`cannjax.{name}` is `{canonical[id(obj)]}`"
        assert line in api, f"docs/api.md must list the alias: {line}"
    public_attrs = {n for n in vars(cannjax) if not n.startswith("_")}
    modules = {n for n in public_attrs if isinstance(getattr(cannjax, n), types.ModuleType)}
    assert public_attrs - modules == set(aliases)


@pytest.mark.parametrize("pkg_name", ALL_PACKAGES)
def test_no_function_shadows_a_module(pkg_name):
    pkg = importlib.import_module(pkg_name)
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name == "__main__":
            continue
        sub = importlib.import_module(f"{pkg_name}.{info.name}")
        assert getattr(pkg, info.name) is sub, (
            f"{pkg_name}.{info.name} is {getattr(pkg, info.name)!r}, not the module {sub.__name__}"
        )


def _public_names():
    for mod_name in PUBLIC:
        if mod_name == "cannjax":
            continue
        for name in importlib.import_module(mod_name).__all__:
            yield pytest.param(mod_name, name, id=f"{mod_name}.{name}")


@pytest.mark.parametrize("mod_name,name", list(_public_names()))
def test_public_name_is_documented(mod_name, name):
    obj = getattr(importlib.import_module(mod_name), name)
    if callable(obj):
        doc = inspect.getdoc(obj)
        assert doc and doc.strip(), f"{mod_name}.{name} has no docstring"
    assert f"`{mod_name}.{name}`" in API_DOC.read_text(), (
        f"docs/api.md does not list {mod_name}.{name}"
    )


def test_api_doc_is_current():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT.parent / "docs" / "gen_api.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert API_DOC.read_text() == gen.render(), "docs/api.md is stale: run python docs/gen_api.py"
