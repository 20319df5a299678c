"""cannjax.health: grad_stats, GradMonitor, find_nonfinite and their renderings."""

import inspect as pyinspect

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import pytest

import cannjax
from cannjax import health
from cannjax.health import GradMonitor, GradStats, find_nonfinite, grad_stats
from tests import _rng as rand
from tests._tables import table_cells

matplotlib.use("Agg")
INF, NAN = float("inf"), float("nan")


def test_grad_stats_values_inside_jit():
    w = jnp.array([[3.0, 0.0], [0.0, -4.0]])
    b = jnp.array([NAN, 1.0, INF, -INF, 0.0])
    tree = {"layer": [w, b], "step": jnp.int32(3), "h": jnp.ones(3, jnp.bfloat16)}
    s = jax.jit(grad_stats)(tree)
    assert isinstance(s, GradStats)
    assert s.paths == ("['h']", "['layer'][0]", "['layer'][1]")  # int leaf skipped
    np.testing.assert_allclose(s.norm[:2], [np.sqrt(3.0), 5.0], rtol=1e-6)
    assert np.isnan(s.norm[2])
    np.testing.assert_allclose(s.max_abs[:2], [1.0, 4.0])
    np.testing.assert_allclose(s.zero_frac, [0.0, 0.5, 0.2])
    np.testing.assert_array_equal(s.nan_count, [0, 0, 1])
    np.testing.assert_array_equal(s.inf_count, [0, 0, 2])
    assert s.nan_count.dtype == jnp.int32 and s.norm.dtype == jnp.float32
    assert not s.finite
    clean = grad_stats({"w": w, "h": jnp.ones(3, jnp.bfloat16)})
    np.testing.assert_allclose(clean.global_norm, np.sqrt(25.0 + 3.0), rtol=1e-6)
    assert clean.finite


def test_grad_stats_every_field_survives_jit_and_vmap():
    s = jax.jit(lambda g: grad_stats(g))({"a": jnp.arange(4.0), "b": jnp.zeros((2, 2))})
    leaves, treedef = jax.tree.flatten(s)
    assert len(leaves) == 6  # five [L] vectors and the global norm; paths are static
    again = jax.jit(lambda x: x)(s)
    assert again.paths == s.paths
    np.testing.assert_array_equal(again.zero_frac, [0.25, 1.0])
    batched = jax.vmap(grad_stats)({"a": jnp.ones((3, 4))})
    assert batched.norm.shape == (3, 1)


def test_grad_stats_of_real_gradients_matches_numpy():
    params = {"w": rand.normal(jax.random.key(0), (4, 3)), "b": jnp.zeros(3)}
    x = rand.normal(jax.random.key(1), (5, 4))
    g = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"][None]) ** 2))(params)
    s = jax.jit(grad_stats)(g)
    for i, path in enumerate(s.paths):
        leaf = np.asarray(g[path[2:-2]])
        np.testing.assert_allclose(s.norm[i], np.linalg.norm(leaf), rtol=1e-5)
        np.testing.assert_allclose(s.max_abs[i], np.abs(leaf).max(), rtol=1e-6)
    flat = np.concatenate([np.ravel(v) for v in jax.tree.leaves(g)])
    np.testing.assert_allclose(s.global_norm, np.linalg.norm(flat), rtol=1e-5)


def test_grad_stats_no_float_leaf():
    with pytest.raises(TypeError, match=r"grad_stats: grads has no floating-point leaf"):
        grad_stats({"n": jnp.int32(1)})


def test_grad_stats_renders():
    s = grad_stats({"w": jnp.array([1.0, NAN])})
    text = str(s)
    assert "['w']" in text and "NaN" in text and "global norm" in text
    h = s._repr_html_()
    assert h.startswith("<table>") and "background:#fdd" in h  # the NaN row is marked


_jit_stats = jax.jit(grad_stats)


def _stats(norm_w, norm_b=1.0):
    return _jit_stats({"w": jnp.array([norm_w]), "b": jnp.array([norm_b])})


def test_monitor_records_every_n_steps_and_flags():
    mon = GradMonitor(every=3, vanishing=1e-6, exploding=100.0)
    seen = {}
    for step, w in enumerate([1.0, 1.0, 1.0, 1e-9, 1.0, 1.0, 1e4, 1.0, 1.0, NAN]):
        seen[step] = mon.update(step, _stats(w))
    assert [r.step for r in mon.history] == [0, 3, 6, 9]
    assert [(f.step, f.path, f.kind) for f in seen[3]] == [(3, "['w']", "vanishing")]
    assert [(f.step, f.path, f.kind) for f in seen[6]] == [
        (6, "['w']", "exploding"),
        (6, "<global>", "exploding"),
    ]
    assert [(f.path, f.kind, f.value) for f in seen[9]] == [("['w']", "nonfinite", 1.0)]
    assert seen[1] == [] and len(mon.flags) == 4
    np.testing.assert_allclose(mon.history[1].stats["norm"], [1.0, 1e-9])


def test_monitor_flags_overflowed_norm_as_exploding():
    mon = GradMonitor(every=1, exploding=1e6)
    flags = mon.update(0, grad_stats({"w": jnp.full(4, 1e30)}))  # norm**2 overflows
    assert [(f.path, f.kind) for f in flags] == [("['w']", "exploding"), ("<global>", "exploding")]
    assert flags[0].value == INF


def test_monitor_flags_a_loss_scale_stuck_at_its_minimum_without_warning(recwarn):
    from cannjax import amp

    mon = GradMonitor(every=1)
    stats = grad_stats({"w": jnp.ones(3)})
    ls = amp.DynamicLossScale(1.0, min_loss_scale=1.0)
    assert mon.update(0, stats, loss_scale=ls) == []
    overflowed = jnp.array(False)
    ls = ls.adjust(overflowed).adjust(overflowed).adjust(overflowed)
    flags = mon.update(1, stats, loss_scale=ls)
    assert flags == [health.HealthFlag(1, "<loss_scale>", "loss_scale_stuck", 3.0)]
    assert not [w for w in recwarn if issubclass(w.category, amp.LossScaleWarning)]
    assert mon.update(2, stats, loss_scale=amp.NoOpLossScale()) == []
    with pytest.raises(TypeError, match=r"GradMonitor.update: loss_scale must be a cannjax.amp"):
        mon.update(3, stats, loss_scale=2.0)


def test_monitor_history_limit_and_renderings():
    mon = GradMonitor(every=1, max_history=2)
    assert "no record" in mon.table()
    for step in range(5):
        mon.update(step, _stats(float(step + 1)))
    assert [r.step for r in mon.history] == [3, 4]
    text = mon.table()
    assert "step 4" in text and "['w']" in text and "['b']" in text
    assert "<table>" in mon._repr_html_()
    ax = mon.plot()
    labels = [ln.get_label() for ln in ax.get_lines()]
    assert {"['w']", "['b']", "global", "flagged"} <= set(labels)
    assert ax.get_yscale() == "log"


def test_monitor_bad_input():
    with pytest.raises(ValueError, match=r"GradMonitor: every must be an int >= 1, got 0"):
        GradMonitor(every=0)
    with pytest.raises(ValueError, match=r"exploding must be a number > vanishing"):
        GradMonitor(vanishing=1.0, exploding=0.5)
    mon = GradMonitor(every=1)
    with pytest.raises(TypeError, match=r"stats must be a GradStats"):
        mon.update(0, {"w": 1.0})
    mon.update(0, _stats(1.0))
    with pytest.raises(ValueError, match=r"the gradient pytree changed"):
        mon.update(1, grad_stats({"other": jnp.ones(2)}))


def _line_of(fn, needle):
    src, start = pyinspect.getsourcelines(fn)
    return start + next(i for i, s in enumerate(src) if needle in s)


def test_find_nonfinite_forward_jax_primitive_with_source_line():
    def loss(x):
        y = x * 2.0
        z = jnp.log(y - 3.0)  # NaN for x < 1.5
        return jnp.sum(z**2)

    r = find_nonfinite(loss, jnp.array([2.0, 1.0]))
    assert r.found and r.stage == "forward" and r.op == "log"
    assert f"test_health.py:{_line_of(loss, 'jnp.log')} (" in r.source
    assert r.source.endswith("loss)")
    assert "NaN=1" in r.outputs[0]
    assert "first non-finite" in str(r) and "<table>" in r._repr_html_()


def test_find_nonfinite_forward_cannjax_op_inside_nested_jit():
    @jax.jit
    def inner(x):
        return cannjax.ops.log(x)

    def loss(x):
        return jnp.sum(inner(x - 1.0))

    r = find_nonfinite(loss, jnp.array([0.5, 2.0]))
    assert (r.stage, r.op, r.primitive) == ("forward", "cannjax.log", "cannjax_op")
    assert "inner" in r.name_stack
    assert f"test_health.py:{_line_of(inner, 'cannjax.ops.log')}" in r.source


def test_find_nonfinite_backward_cannjax_op():
    def loss(x):
        h = cannjax.ops.tanh(x)
        return jnp.sum(cannjax.ops.sqrt(h))  # d sqrt(h) at h = 0 is inf

    x = jnp.array([0.0, 0.5])
    assert bool(jnp.isfinite(loss(x)))
    assert not bool(jnp.all(jnp.isfinite(jax.grad(loss)(x))))
    r = find_nonfinite(loss, x)
    assert (r.stage, r.op) == ("backward", "cannjax.sqrt")
    assert r.primitive in ("cannjax_op", "cannjax_lin")
    assert "Inf=1" in r.outputs[0]
    assert f"test_health.py:{_line_of(loss, 'cannjax.ops.sqrt')}" in r.source


def test_find_nonfinite_backward_jax_primitive():
    def loss(x):
        return jnp.sum(jnp.sqrt(x) * 0.0)

    r = find_nonfinite(loss, jnp.array([0.0, 1.0]))
    assert (r.stage, r.op) == ("backward", "sqrt")


def test_find_nonfinite_follows_argnums():
    def loss(p, x):
        return jnp.sum(p * jnp.sqrt(x))  # d/dx = inf at x = 0; d/dp = sqrt(0) = 0

    p, x = jnp.ones(2), jnp.array([0.0, 4.0])
    assert not find_nonfinite(loss, p, x).found
    r = find_nonfinite(loss, p, x, argnums=1)
    assert (r.stage, r.op) == ("backward", "sqrt")


def test_find_nonfinite_clean_program_and_input():
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}

    def loss(p, x):
        return jnp.mean(jax.nn.relu(x @ p["w"] + p["b"][None]) ** 2)  # relu: custom_jvp

    x = jnp.ones((4, 3))
    r = find_nonfinite(loss, params, x)
    assert not r.found and r.operators > 3
    assert "no NaN/Inf" in str(r)
    bad = find_nonfinite(loss, params, x.at[0, 0].set(NAN))
    assert bad.stage == "input" and "NaN=1" in bad.outputs[0]


def test_find_nonfinite_bad_input():
    with pytest.raises(TypeError, match=r"find_nonfinite: fun must be callable"):
        find_nonfinite(None, 1.0)
    with pytest.raises(ValueError, match=r"argnums 3 out of range for 1 arguments"):
        find_nonfinite(jnp.sum, jnp.ones(2), argnums=3)


def test_public_namespace():
    assert cannjax.health is health
    assert set(health.__all__) >= {"grad_stats", "GradMonitor", "find_nonfinite"}


def test_monitor_prints_an_aligned_table_and_a_short_repr():
    mon = GradMonitor(every=1, vanishing=1e-6, exploding=1e3)
    assert repr(mon) == "GradMonitor(every=1, vanishing=1e-06, exploding=1000: 0 records, 0 flags)"
    mon.update(0, grad_stats({"w": jnp.array([3.0, 4.0]), "bias<b>": jnp.array([NAN, 1.0])}))
    first, table = str(mon).split("\n", 1)
    assert first.startswith("step 0: global norm nan (1 records")
    head, *rows = table_cells(table)
    assert head == ["leaf", "norm", "max|g|", "zeros", "NaN", "Inf", "flag"]
    assert rows == [
        ["['bias<b>']", "nan", "nan", "0.0", "1", "0", "nonfinite"],
        ["['w']", "5.0000", "4.0000", "0.0", "0", "0", ""],
    ]
    assert repr(mon) == "GradMonitor(every=1, vanishing=1e-06, exploding=1000: 1 records, 1 flags)"


def test_grad_stats_repr_is_one_line():
    s = grad_stats({"w": jnp.array([3.0, 4.0]), "b": jnp.array([NAN, 1.0])})
    assert repr(s) == "GradStats(2 leaves: global norm nan, NaN/Inf in ['b'])"
    s = grad_stats({"w": jnp.array([3.0, 4.0])})
    assert repr(s) == "GradStats(1 leaves: global norm 5.0000, finite)"
    many = grad_stats({k: jnp.array([jnp.inf]) for k in "abcde"})
    assert repr(many).endswith("NaN/Inf in ['a'], ['b'], ['c'] and 2 more)")
    seen = []
    jax.jit(lambda g: seen.append(repr(grad_stats(g))) or 0)({"w": jnp.ones(2)})
    assert seen == ["GradStats(1 leaves, traced)"]  # no host values while tracing
    stacked = jax.vmap(grad_stats)({"w": jnp.ones((3, 2))})
    assert repr(stacked) == "GradStats(1 leaves, stacked (3, 1))"


def test_nonfinite_report_text_names_the_file_not_its_folders():
    def loss(x):
        return jnp.sum(jnp.log(x - 1.0))  # NaN for x < 1

    r = find_nonfinite(loss, jnp.array([0.5, 2.0]))
    line = _line_of(loss, "jnp.log")
    assert r.source.startswith("/") and f"/tests/test_health.py:{line} (" in r.source  # the data
    short = f"test_health.py:{line} (loss)"
    assert repr(r) == str(r)  # a REPL shows the table, as print does
    rows = dict((k, v) for k, v in table_cells(str(r))[1:])
    assert rows["source"] == short and rows["operator"] == "log"
    assert "/tests/" not in str(r) + r._repr_html_()
    assert f"<td>{short}</td>" in r._repr_html_()
    clean = find_nonfinite(lambda x: jnp.sum(x * 2.0), jnp.ones(2))
    assert (
        repr(clean)
        == str(clean)
        == ("no NaN/Inf in the forward values or backward cotangents (2 operators)")
    )


def test_monitor_html_is_an_escaped_table():
    mon = GradMonitor(every=1)
    mon.update(0, grad_stats({"w": jnp.array([3.0, 4.0]), "bias<b>": jnp.array([NAN, 1.0])}))
    page = mon._repr_html_()
    assert page.startswith("<table><caption>step 0: global norm nan</caption>")
    assert "<th>max|g|</th>" in page and page.count("<tr") == 3
    assert '<tr style="background:#fdd"><td>[&#x27;bias&lt;b&gt;&#x27;]</td>' in page
    assert "<td>[&#x27;w&#x27;]</td><td>5.0000</td>" in page and "<b>" not in page
