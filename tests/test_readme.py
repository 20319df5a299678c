"""The README's example does what its comments say.

The example's lines are evaluated one by one, as in a REPL; each expression line's value
is checked against the claim in its comment. A comment this file does not know fails
the test, so a changed example gets its claim checked too.
"""

import ast
import io
import pathlib
import re
import tokenize

import jax
import jax.numpy as jnp
import numpy as np

import cannjax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example() -> str:
    (block,) = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return block


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of the comment ending that line."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0]: t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT}


def _run(source: str) -> tuple[dict, dict[str, object]]:
    """Runs ``source`` statement by statement: ``(namespace, {comment: value})``.

    A commented statement's value is its expression's value, or for an assignment the
    value assigned.
    """
    namespace: dict = {}
    comments = _comments(source)
    claims = {}
    for stmt in ast.parse(source).body:
        module = ast.Module([stmt], type_ignores=[])
        if isinstance(stmt, ast.Expr):
            code = compile(ast.Expression(stmt.value), "README.md", "eval")
            value = eval(code, namespace)
        else:
            exec(compile(module, "README.md", "exec"), namespace)
            targets = stmt.targets if isinstance(stmt, ast.Assign) else []
            value = namespace[targets[0].id] if len(targets) == 1 else None
        if stmt.end_lineno in comments:
            claims[comments[stmt.end_lineno]] = value
    return namespace, claims


def _matches_listed(value, listed: str) -> bool:
    """``value`` against ``[1., 0., 0.867...]``: exact entries, or a printed prefix."""
    items = [s.strip() for s in listed.strip("[]").split(",")]
    value = np.asarray(value)
    if value.shape != (len(items),):
        return False
    for v, item in zip(value.tolist(), items):
        if item.endswith("..."):
            if not f"{v:.12f}".startswith(item[:-3]):
                return False
        elif v != float(item):
            return False
    return True


def test_readme_example_does_what_its_comments_say():
    namespace, claims = _run(_example())
    x = namespace["x"]
    checked = set()

    def claim(text):
        assert text in claims, f"README's example no longer says {text!r}: {sorted(claims)}"
        checked.add(text)
        return claims[text]

    g = claim("[1., 0., 0.867...]: no NaN")
    assert np.all(np.isfinite(g)) and _matches_listed(g, "[1., 0., 0.867...]"), g

    jac = claim("forward mode works too")  # softplus' = sigmoid: 0.5 at 0
    np.testing.assert_allclose(jac, np.diag([0.5, 0.5]), rtol=1e-6)

    residuals = claim("1 residual (plain JAX: 7)")
    assert residuals.count == 1
    plain = cannjax.inspect.residuals(lambda x: jax.nn.gelu(x).sum(), x)
    assert plain.count == 7

    claim("the harness every op passes")  # check_op raised nothing when it ran

    act = claim("one operator, one residual")
    ones = jnp.ones(3)
    eqns = jax.make_jaxpr(act)(ones).jaxpr.eqns
    assert [e.primitive.name for e in eqns] == ["cannjax_op"], eqns
    assert cannjax.inspect.residuals(lambda x: act(x).sum(), ones).count == 1
    np.testing.assert_allclose(act(ones), jnp.tanh(ones) * jax.nn.sigmoid(ones), rtol=1e-6)

    assert checked == set(claims), f"unchecked claims in README's example: {set(claims) - checked}"


def test_listed_values_are_read_as_the_comment_prints_them():
    # The matcher itself: a prefix with "..." and exact entries.
    assert _matches_listed([1.0, -0.0, 0.86737], "[1., 0., 0.867...]")
    assert _matches_listed([1.0, 0.0, 0.8679], "[1., 0., 0.867...]")  # truncated, not rounded
    assert not _matches_listed([1.0, 0.0, 0.868], "[1., 0., 0.867...]")
    assert not _matches_listed([1.0, 0.5, 0.867], "[1., 0., 0.867...]")
    assert not _matches_listed([1.0, 0.0], "[1., 0., 0.867...]")
