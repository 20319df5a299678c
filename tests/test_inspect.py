"""cannjax.inspect: residual tables, compiled memory and fusion reports."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import cannjax
from cannjax import inspect
from tests._tables import table_cells

X = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)


def sin_exp(x):
    return jnp.sin(jnp.exp(x)).sum()


def test_residuals_rows_totals_and_rendering():
    rep = inspect.residuals(sin_exp, X)
    assert rep.count == 2 and rep.total_bytes == 2 * X.nbytes
    assert {r.shape for r in rep.rows} == {(3, 4)}
    assert all("test_inspect.py" in r.source for r in rep.rows)  # the user's source line
    assert rep.by_op() == {"-": 2 * X.nbytes}
    assert "2 residuals, 96 bytes" in str(rep)
    assert rep._repr_html_().startswith("<table>") and "96 bytes" in rep._repr_html_()


def test_residuals_of_fused_function_name_the_operator_and_the_line():
    rep = inspect.residuals(cannjax.fuse(sin_exp), X)
    (row,) = rep.rows
    assert row.op == "fused_exp_sin" and row.nbytes == X.nbytes
    assert "test_inspect.py" in row.source  # the user's line, not cannjax's
    assert rep.by_op() == {"fused_exp_sin": X.nbytes}


def _softmax_loss(x):
    return cannjax.ops.softmax(x).sum()  # the line a residual of softmax must name


def test_residual_named_by_an_operator_gives_the_users_line():
    # The op names its residual inside cannjax (core/primitives.py); the report must
    # give the first frame outside cannjax: the call above.
    rep = inspect.residuals(_softmax_loss, X)
    (row,) = [r for r in rep.rows if r.op == "softmax"]
    line = _softmax_loss.__code__.co_firstlineno + 1
    assert f" from {__file__}:{line}:" in row.source, row.source
    assert f"test_inspect.py:{line} (_softmax_loss)" in str(rep)


def test_memory_report():
    m = inspect.memory(sin_exp, X)
    assert m.argument_bytes == X.nbytes and m.output_bytes == X.nbytes
    assert "MiB" in str(m) and "compiled memory" in m._repr_html_()


def test_fusion_report_lists_fused_and_kept_in_program_order():
    def f(x, w):
        h = jnp.tanh(x @ w) * jnp.exp(x)  # two inputs: x @ w and x
        h = lax.cond(h.sum() > 0, jnp.sin, jnp.cos, h)
        return jnp.sum(jnp.sin(h) * h)

    w = jnp.ones((4, 4)) * 0.1
    rep = inspect.fusion(f, X, w)
    kinds = [(r.kind, r.what) for r in rep.rows]
    assert kinds[0] == ("kept", "dot_general")
    assert ("fused", "tanh exp mul") in kinds
    assert ("fused", "sin mul") in kinds
    reasons = {r.what: r.reason for r in rep.kept}
    assert reasons["cond"] == "control flow (cond): left intact"
    assert reasons["dot_general"] == "matmul/convolution: left as is"
    fused = {r.what: r for r in rep.fused}
    assert fused["tanh exp mul"].saved == "float32[3,4], float32[3,4] (inputs)"
    assert fused["sin mul"].saved == "d float32[3,4] (derivative)"
    assert fused["sin mul"].saved_bytes == X.nbytes
    assert all("test_inspect.py" in r.line for r in rep.rows)
    text = str(rep)
    assert "2 fused clusters" in text and "left intact" in text
    assert "<caption>2 fused clusters" in rep._repr_html_()


def test_fusion_report_of_scan_body_and_levels():
    def net(x, ws):
        y, _ = lax.scan(lambda c, w: (jax.nn.gelu(c @ w), None), x, ws)
        return y.sum()

    ws = jnp.ones((2, 4, 4)) * 0.1
    rep = inspect.fusion(net, X, ws, level="recompute")
    (body,) = [r for r in rep.fused if r.where == "scan body"]
    assert body.saved == "float32[3,4] (inputs)"
    rep = inspect.fusion(cannjax.fuse(net), X, ws)  # an already fused function
    (body,) = [r for r in rep.fused if r.where == "scan body"]
    assert body.saved.endswith("(derivative)")


def test_fusion_report_when_nothing_can_be_fused():
    def f(x):
        return jnp.exp(x) if float(x.sum()) > 0 else x

    rep = inspect.fusion(f, X + 2.0)
    assert rep.rows == () and "concrete values" in rep.note
    assert "0 fused clusters" in str(rep)


def test_bad_input():
    for fn in (inspect.residuals, inspect.memory, inspect.fusion):
        with pytest.raises(TypeError, match=r"cannjax.inspect.\w+: fun must be callable"):
            fn(3, X)
    with pytest.raises(ValueError, match="cannjax.fuse: level must be one of"):
        inspect.fusion(sin_exp, X, level="everything")


# ------------------------------------------------------------------ rendering (issue 17)
def test_residual_report_prints_aligned_with_short_locations():
    rep = inspect.residuals(lambda x: jnp.sin(jnp.exp(x)).sum(), X)
    text = str(rep)
    head, *rows = table_cells(text.rsplit("\n", 1)[0])
    assert head == ["shape", "dtype", "bytes", "op", "source"]
    assert [r[:3] for r in rows] == [["(3, 4)", "float32", "48"]] * 2
    for *_, source in rows:  # the file name and line, not the path and column
        assert re.fullmatch(r"output of (exp|cos) from test_inspect\.py:\d+ \(<lambda>\)", source)
    assert rep.rows[0].source.startswith("output of exp from /")  # the data keeps the path
    assert "/" not in text and not re.search(r"\.py:\d+:\d+", text)
    assert text.endswith("\n2 residuals, 96 bytes")
    assert repr(rep) == text  # a REPL shows the table, as print does


def test_residual_report_html_is_an_escaped_table():
    rep = inspect.residuals(lambda x: jnp.sin(jnp.exp(x)).sum(), X)
    page = rep._repr_html_()
    assert page.startswith("<table><caption>2 residuals, 96 bytes</caption>")
    assert page.endswith("</table>") and page.count("<tr") == 3
    assert "(&lt;lambda&gt;)" in page and "<lambda>" not in page
    assert re.search(r"<td>output of exp from test_inspect\.py:\d+ \(&lt;lambda&gt;\)</td>", page)


def test_memory_report_prints_aligned_bytes_and_mib():
    m = inspect.memory(sin_exp, X)
    head, *rows = table_cells(str(m))
    assert head == ["memory", "bytes", "MiB", "what"]
    cells = {r[0]: r[1:3] for r in rows}
    assert cells["arguments"] == ["48", "0.00"] and cells["outputs"] == ["48", "0.00"]
    assert list(cells) == ["temp", "arguments", "outputs", "aliased"]
    line = str(m).splitlines()[3]  # numbers right-aligned under their header
    assert line.index("48") + 2 == str(m).splitlines()[0].index("bytes") + len("bytes")
    assert repr(m) == str(m)
    page = m._repr_html_()
    assert page.startswith("<table><caption>compiled memory</caption>")
    assert "<td>XLA&#x27;s scratch buffers (activations, residuals)</td>" in page


def _reports():
    """One of each report cannjax returns, by name."""
    from cannjax import backend, dynamic, health

    geared = dynamic.geared(lambda total, x, weights: total + (x * weights).sum(), [4, 8])
    geared(jnp.zeros(()), jnp.ones((2, 3)))
    return {
        "ResidualReport": inspect.residuals(sin_exp, X),
        "MemoryReport": inspect.memory(sin_exp, X),
        "FusionReport": inspect.fusion(sin_exp, X),
        "OptimizeReport": inspect.optimize(lambda w, x: jnp.mean(jax.nn.gelu(x @ w)), X, X.T),
        "NonFiniteReport": health.find_nonfinite(lambda x: jnp.log(x - 1.0).sum(), X),
        "BackendInfo": backend.info(),
        "Gears": dynamic.plan_gears([3, 5, 8], 2),
        "GearedStep": geared,
    }


def test_every_report_shows_its_table_in_a_repl_and_a_notebook():
    # A REPL echoes repr(value): the same table as print, not "ResidualReport(1 residuals,
    # 12 bytes)" nor the dataclass fields. A notebook shows _repr_html_.
    for name, report in _reports().items():
        text = str(report)
        assert repr(report) == text, name
        assert re.search(r"^ *-+((  |-\+-)-+)+$", text, re.M), f"{name}: no table:\n{text}"
        assert "<table>" in report._repr_html_(), name


def test_ipython_displays_the_report_table():
    formatters = pytest.importorskip("IPython.core.formatters")
    rep = inspect.residuals(sin_exp, X)
    assert formatters.PlainTextFormatter()(rep) == str(rep)
    assert formatters.HTMLFormatter()(rep) == rep._repr_html_()


def test_optimize_report_measures_bfloat16_arguments_and_loss():
    # numpy does not count bfloat16 as inexact: the report once left such arguments
    # undifferentiated and summed no output, and measured nothing (0 bytes).
    x = jax.random.normal(jax.random.key(0), (64, 128))
    w = jax.random.normal(jax.random.key(1), (128, 256))

    def f(x, w):
        return jnp.sum(jnp.tanh(x @ w))

    wide = inspect.optimize(f, x, w)
    half = inspect.optimize(f, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    # The same arrays are saved, each in half the bytes.
    assert wide.residual_bytes[0] > 0
    assert [2 * b for b in half.residual_bytes] == list(wide.residual_bytes)
