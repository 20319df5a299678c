"""The optimize package's modules import each other without a cycle, and at the top: no
finder dodges a cycle by importing inside a function, and no finder swallows every
exception (issue 46: a finder that raises is a bug; the planner alone reports one)."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "cannjax" / "_src" / "optimization"
PREFIX = "cannjax._src.optimization"


def _imports(tree: ast.AST, top_only: bool) -> set[str]:
    """The package's modules imported by ``tree`` (at module level only, or anywhere), by
    their dotted names inside the package (``finders.attention``)."""
    nodes = tree.body if top_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PREFIX):
            inside = node.module[len(PREFIX) + 1 :]
            # `from package import module` names modules; `from module import name` does not
            out |= {f"{inside}.{a.name}".lstrip(".") for a in node.names} & MODULES
            if inside in MODULES:
                out.add(inside)
    return out


def _name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = frozenset(_name(p) for p in PACKAGE.rglob("*.py"))


def _modules() -> dict[str, ast.AST]:
    return {_name(p): ast.parse(p.read_text()) for p in PACKAGE.rglob("*.py")}


def test_no_import_cycle():
    graph = {name: _imports(tree, top_only=True) for name, tree in _modules().items()}
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != "open", " -> ".join([*path, node, nxt])
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert {"rewrite", "finders.attention", "finders.cross_entropy"} <= set(state)
    assert "finders.cross_entropy" in graph["finders.attention"]  # imports are read


def test_imports_are_read_as_modules():
    a = ast.parse(f"from {PREFIX}.finders import dense\n")
    b = ast.parse(f"from {PREFIX}.finders.attention import find_attention\n")
    assert _imports(a, top_only=True) == {"finders", "finders.dense"}
    assert _imports(b, top_only=True) == {"finders.attention"}


def test_no_import_inside_a_function():
    for name, tree in _modules().items():
        inner = _imports(tree, top_only=False) - _imports(tree, top_only=True)
        assert not inner, (name, inner)


def test_only_the_planner_catches_every_exception():
    catch_all = {}
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ExceptHandler):
                continue
            caught = node.type.id if isinstance(node.type, ast.Name) else None
            if node.type is None or caught in ("Exception", "BaseException"):
                catch_all.setdefault(name, []).append(node.lineno)
    # rewrite.plan_substitution: a finder's error becomes a report row (raised under the
    # test suite's strict mode), never a user's traceback.
    assert set(catch_all) == {"rewrite"}, catch_all
    assert len(catch_all["rewrite"]) == 2, catch_all
