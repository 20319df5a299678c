"""Every public name has a docstring; __init__ modules only re-export."""

import ast
import importlib
import pathlib

import pytest

import cannjax

PUBLIC_MODULES = [
    "cannjax",
    "cannjax.core",
    "cannjax.ops",
    "cannjax.testing",
    "cannjax.inspect",
    "cannjax.transforms",
    "cannjax.backend",
    "cannjax.backend.ascend",
    "cannjax.parallel",
    "cannjax.health",
    "cannjax.amp",
    "cannjax.remat",
    "cannjax.transforms.remat",
    "cannjax.transforms.remat_policies",
]


def _public_names():
    for mod_name in PUBLIC_MODULES:
        mod = importlib.import_module(mod_name)
        for name in mod.__all__:
            yield pytest.param(mod_name, name, id=f"{mod_name}.{name}")


@pytest.mark.parametrize("mod_name,name", list(_public_names()))
def test_public_name_has_a_docstring(mod_name, name):
    obj = getattr(importlib.import_module(mod_name), name)
    doc = getattr(obj, "__doc__", None)
    assert doc and doc.strip(), f"{mod_name}.{name} has no docstring"


def test_init_files_only_reexport():
    root = pathlib.Path(cannjax.__file__).parent
    for init in root.rglob("__init__.py"):
        tree = ast.parse(init.read_text())
        for node in tree.body:
            ok = (
                isinstance(node, (ast.Import, ast.ImportFrom))
                or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
                or (
                    isinstance(node, ast.Assign)
                    and node.targets[0].id in ("__all__", "__version__")
                )
            )
            assert ok, f"{init}: line {node.lineno} is not a re-export"
