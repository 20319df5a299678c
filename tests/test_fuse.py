"""cannjax.fuse: same values and gradients, fewer residuals, every transform composes."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import cannjax
from cannjax.inspect import compiled_memory, residuals
from tests import _rng as rand
from tests._tables import table_cells
from tests._tiers import sample


# ---------------------------------------------------------------- functions under test
def sin_exp(x):
    return jnp.sin(jnp.exp(x))


def chain5(h):  # five elementwise ops: sin, cos, exp, mul, tanh
    return jnp.tanh(jnp.sin(h) * jnp.exp(jnp.cos(h)))


def relu_chain(x):  # custom_jvp (jax.nn.relu) inside a chain
    return jax.nn.relu(jnp.sin(x) * 2.0) * jnp.cos(x)


def masked(x):  # a boolean mask made in the cluster and also used outside it
    m = x > 0.1
    y = jnp.where(m, jnp.exp(x), jnp.sin(x) * x)
    return y * m.sum()


def affine_mlp(x, w, b):  # matmul, then bias (row broadcast) + activation
    return jnp.tanh(x @ w + b[None, :]) * jax.nn.sigmoid(x @ w)


def two_outputs(x, y):  # one cluster with two outputs and two inputs
    a = jnp.sin(x) * jnp.exp(y)
    b = jnp.cos(a) + y * y
    return a, b


def mixed_precision(x):  # a cast up inside the cluster
    h = x.astype(jnp.float32)
    return (jnp.tanh(h) * jnp.exp(-h)).astype(x.dtype)


def with_int(x, k):  # an integer (non-differentiable) input to the cluster
    return jnp.sin(x * k) * jnp.exp(x)


CASES = {
    "sin_exp": (sin_exp, lambda k: (rand.normal(k, (5, 7)),)),
    "chain5": (chain5, lambda k: (rand.normal(k, (5, 7)),)),
    "gelu": (lambda x: jax.nn.gelu(x) * 2.0, lambda k: (rand.normal(k, (6, 4)),)),
    "silu": (lambda x: jax.nn.silu(jnp.sin(x)), lambda k: (rand.normal(k, (6, 4)),)),
    "relu_chain": (relu_chain, lambda k: (rand.normal(k, (9,)),)),
    "masked": (masked, lambda k: (rand.normal(k, (9,)),)),
    "affine_mlp": (
        affine_mlp,
        lambda k: tuple(
            rand.normal(s, sh) for s, sh in zip(jax.random.split(k, 3), ((4, 3), (3, 5), (5,)))
        ),
    ),
    "two_outputs": (
        lambda x, y: sum(jnp.sum(o) for o in two_outputs(x, y)),
        lambda k: tuple(rand.normal(s, (4, 3)) for s in jax.random.split(k)),
    ),
    "with_int": (with_int, lambda k: (rand.normal(k, (8,)), jnp.arange(8))),
}


def close(a, b, dtype):
    tol = dict(rtol=2e-5, atol=2e-6) if dtype == "float32" else dict(rtol=1e-12, atol=1e-13)
    chex.assert_trees_all_close(a, b, **tol)


def _args(case, dtype):
    _, make = CASES[case]
    args = make(jax.random.key(0))
    return tuple(a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args)


def _diff_argnums(args):
    return tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))


@pytest.mark.parametrize(
    "dtype,level", [("float32", "derivative"), ("float64", "derivative"), ("float32", "recompute")]
)
@pytest.mark.parametrize("case", sample(sorted(CASES), every=2))
def test_values_and_gradients_equal_unfused(case, dtype, level):
    fun = CASES[case][0]
    with jax.enable_x64(dtype == "float64"):
        args = _args(case, dtype)
        loss = lambda *a: jnp.sum(fun(*a) ** 2)  # noqa: E731
        fused = cannjax.fuse(loss, level=level)
        argnums = _diff_argnums(args)
        close(fused(*args), loss(*args), dtype)
        close(jax.grad(fused, argnums)(*args), jax.grad(loss, argnums)(*args), dtype)
        close(jax.jit(jax.grad(fused, argnums))(*args), jax.grad(loss, argnums)(*args), dtype)
        # forward mode: the fused operator's tangent rule
        tangents = tuple(jnp.ones_like(args[i]) for i in argnums)

        def along(f):
            return lambda *d: f(
                *[d[argnums.index(i)] if i in argnums else a for i, a in enumerate(args)]
            )

        primals = tuple(args[i] for i in argnums)
        close(
            jax.jvp(along(fused), primals, tangents), jax.jvp(along(loss), primals, tangents), dtype
        )


def test_fused_program_binds_one_cannjax_operator():
    prims = [e.primitive.name for e in jax.make_jaxpr(cannjax.fuse(chain5))(X).jaxpr.eqns]
    assert prims == ["cannjax_op"]  # the whole chain is one operator
    # under grad, the operator's linear part is what reverse mode transposes
    lin = jax.linearize(cannjax.fuse(chain5), X)[1]
    prims = [e.primitive.name for e in jax.make_jaxpr(lin)(X).jaxpr.eqns]
    assert prims == ["cannjax_lin"]


# ---------------------------------------------------------------- residual counts
@pytest.mark.parametrize(
    "fun,plain,fused",
    [(sin_exp, 2, 1), (chain5, 6, 1), (jax.nn.gelu, 7, 1), (jax.nn.silu, 3, 1)],
)
@pytest.mark.parametrize("level", cannjax.fusion.LEVELS)
def test_one_full_size_residual_per_chain(fun, plain, fused, level):
    x = jnp.linspace(-2.0, 2.0, 64).reshape(8, 8)
    loss = lambda x: fun(x).sum()  # noqa: E731
    before = residuals(loss, x)
    after = residuals(cannjax.fuse(loss, level=level), x)
    assert before.count == plain
    assert after.count == fused
    assert after.total_bytes == x.nbytes
    row = after.rows[0]
    if level == "recompute" and row.source.startswith("from the argument"):
        return  # the cluster's input itself: kept unnamed (docs/design.md)
    assert row.op.startswith("fused_")
    assert row.source.endswith("(<lambda>)") or "test_fuse.py" in row.source


def test_levels_keep_derivative_or_inputs():
    x = jnp.linspace(-1.0, 1.0, 8)
    loss = lambda x: sin_exp(x).sum()  # noqa: E731
    (d,) = residuals(cannjax.fuse(loss, level="derivative"), x).rows
    (r,) = residuals(cannjax.fuse(loss, level="recompute"), x).rows
    assert "cannjax.fused_exp_sin.d'" in d.source
    # Recompute keeps the cluster's input, here the function's argument (unnamed, as
    # every residual that is an operator's own input: docs/design.md).
    assert r.source == "from the argument x" and r.nbytes == x.nbytes


def test_affine_cluster_keeps_nothing():
    x = jnp.linspace(-1.0, 1.0, 8)
    loss = lambda x: jnp.sum((2.0 * x + 1.0) * 3.0 - x)  # noqa: E731
    for level in cannjax.fusion.LEVELS:
        assert residuals(cannjax.fuse(loss, level=level), x).count == 0
        close(jax.grad(cannjax.fuse(loss, level=level))(x), jax.grad(loss)(x), "float32")


def test_cast_up_inside_cluster_keeps_the_narrow_input():
    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.bfloat16)
    loss = lambda x: mixed_precision(x).astype(jnp.float32).sum()  # noqa: E731
    rep = residuals(cannjax.fuse(loss), x)
    assert rep.total_bytes == x.nbytes  # bf16 input, not the f32 derivative
    g, want = jax.grad(cannjax.fuse(loss))(x), jax.grad(loss)(x)
    np.testing.assert_allclose(np.float32(g), np.float32(want), rtol=1e-2)


# ---------------------------------------------------------------- the scan network
def _scan_net(act):
    def net(x, ws):
        def body(c, w):
            return act(c @ w), None

        y, _ = lax.scan(body, x, ws)
        return jnp.mean(y * y)

    return net


def _net_args(b, w, layers):
    x = rand.normal(jax.random.key(1), (b, w))
    ws = rand.normal(jax.random.key(2), (layers, w, w)) / np.sqrt(w)
    return x, ws


@pytest.mark.parametrize("act", [chain5, jax.nn.gelu, jax.nn.silu], ids=["chain5", "gelu", "silu"])
def test_scan_body_is_fused_and_residuals_shrink(act):
    x, ws = _net_args(8, 16, 4)
    net = _scan_net(act)
    fused = cannjax.fuse(net)
    close(jax.grad(fused, (0, 1))(x, ws), jax.grad(net, (0, 1))(x, ws), "float32")
    before, after = residuals(net, x, ws), residuals(fused, x, ws)
    stacked = 4 * 8 * 16 * 4  # one (layers, batch, width) f32 array
    # plain JAX stacks several activations per layer; fused: the carry and one per cluster
    assert after.total_bytes <= ws.nbytes + x.nbytes + 2 * stacked
    assert before.total_bytes - after.total_bytes >= stacked


def _temp_mib(net, x, ws):
    return compiled_memory(jax.grad(net, 1), x, ws).temp_bytes / 2**20


def test_scan_memory_ratio_benchmark_size():
    # The benchmark network: 16 layers, batch 256, width 1024, a 5-op chain (compile only,
    # a few seconds). Compiled temp memory of the gradient under fuse <= 0.4x plain JAX.
    x, ws = _net_args(256, 1024, 16)
    net = _scan_net(chain5)
    plain, fused = _temp_mib(net, x, ws), _temp_mib(cannjax.fuse(net), x, ws)
    assert fused <= 0.4 * plain, (fused, plain)
    assert fused < 40  # 16 layers x (carry + derivative) x 1 MiB, plus the gradient


@pytest.mark.slow
@pytest.mark.parametrize(
    "act,ratio", [(jax.nn.gelu, 0.4), (jax.nn.silu, 0.6)], ids=["gelu", "silu"]
)
def test_scan_memory_ratio_gelu_silu(act, ratio):
    x, ws = _net_args(256, 1024, 16)
    net = _scan_net(act)
    plain, fused = _temp_mib(net, x, ws), _temp_mib(cannjax.fuse(net), x, ws)
    assert fused <= ratio * plain, (fused, plain)


# ---------------------------------------------------------------- transforms compose
X = jnp.linspace(-1.5, 1.5, 12).reshape(3, 4)


def test_value_and_grad_vjp_jacfwd_jacrev_hessian():
    f = lambda x: chain5(x).sum()  # noqa: E731
    g = cannjax.fuse(f)
    close(jax.value_and_grad(g)(X), jax.value_and_grad(f)(X), "float32")
    v1, pull1 = jax.vjp(cannjax.fuse(chain5), X)
    v2, pull2 = jax.vjp(chain5, X)
    close((v1, pull1(X)), (v2, pull2(X)), "float32")
    close(jax.jacfwd(cannjax.fuse(chain5))(X[0]), jax.jacfwd(chain5)(X[0]), "float32")
    close(jax.jacrev(cannjax.fuse(chain5))(X[0]), jax.jacrev(chain5)(X[0]), "float32")
    close(jax.hessian(g)(X[0]), jax.hessian(f)(X[0]), "float32")
    lin = jax.linearize(cannjax.fuse(chain5), X)[1]
    close(lin(X), jax.linearize(chain5, X)[1](X), "float32")


def test_vmap_in_and_out():
    f = lambda x: chain5(x).sum()  # noqa: E731
    g = cannjax.fuse(f)
    close(jax.vmap(jax.grad(g))(X), jax.vmap(jax.grad(f))(X), "float32")
    close(jax.grad(lambda x: jax.vmap(g)(x).sum())(X), jax.vmap(jax.grad(f))(X), "float32")
    close(jax.jit(jax.vmap(cannjax.fuse(chain5)))(X), jax.vmap(chain5)(X), "float32")


def test_checkpoint_around_and_inside():
    f = lambda x: chain5(x).sum()  # noqa: E731
    close(jax.grad(jax.checkpoint(cannjax.fuse(f)))(X), jax.grad(f)(X), "float32")
    inner = lambda x: jax.checkpoint(chain5)(jnp.sin(x) * 2.0).sum()  # noqa: E731
    close(jax.grad(cannjax.fuse(inner))(X), jax.grad(inner)(X), "float32")
    plan, _ = cannjax.fuse(inner).fusion_plan(X)
    (ckpt,) = [k for k in plan.kept if k.primitive in ("remat2", "checkpoint")]
    assert ckpt.body is not None and len(ckpt.body.fused) == 1


def test_nested_fuse_and_fused_calls():
    f = lambda x: chain5(x).sum()  # noqa: E731
    close(jax.grad(cannjax.fuse(cannjax.fuse(f)))(X), jax.grad(f)(X), "float32")
    act = cannjax.fuse(chain5)
    outer = lambda x: jnp.sum(act(jnp.sin(x) * x) ** 2)  # noqa: E731
    plain = lambda x: jnp.sum(chain5(jnp.sin(x) * x) ** 2)  # noqa: E731
    close(jax.grad(cannjax.fuse(outer))(X), jax.grad(plain)(X), "float32")


def test_pytrees_and_keyword_arguments():
    def f(params, x, *, scale):
        h = jnp.tanh(x @ params["w"]) * jnp.exp(-(params["b"][None, :] ** 2))
        return {"y": h * scale, "aux": (jnp.sin(h) * h, x.sum())}

    params = {"w": jnp.ones((4, 2)) * 0.3, "b": jnp.array([0.5, -0.2])}
    g = cannjax.fuse(f)
    close(g(params, X, scale=2.0), f(params, X, scale=2.0), "float32")
    loss = lambda p, f=f: jnp.sum(f(p, X, scale=2.0)["aux"][0])  # noqa: E731
    close(jax.grad(lambda p: loss(p, g))(params), jax.grad(loss)(params), "float32")


def test_closure_over_traced_values():
    w = jnp.linspace(0.1, 0.9, 4)

    @jax.jit
    def outer(w, x):
        return cannjax.fuse(lambda x: jnp.sum(jnp.sin(x * w[None, :]) * jnp.exp(w[None, :])))(x)

    def plain(w, x):
        return jnp.sum(jnp.sin(x * w[None, :]) * jnp.exp(w[None, :]))

    close(jax.grad(outer, (0, 1))(w, X), jax.grad(plain, (0, 1))(w, X), "float32")


# ---------------------------------------------------------------- tracing cost
def test_traced_once_per_signature():
    @chex.assert_max_traces(n=1)
    def f(x):
        return chain5(x).sum()

    g = cannjax.fuse(f)
    for _ in range(3):
        g(X)
        jax.grad(g)(X)
        jax.jit(jax.grad(g))(X + 1.0)
        jax.vmap(g)(X[None])
    chex.clear_trace_counter()

    @chex.assert_max_traces(n=2)
    def h(x):
        return chain5(x).sum()

    g = cannjax.fuse(h)
    for _ in range(2):
        g(X)
        g(X[0])  # a second signature: traced once more
    with pytest.raises(AssertionError):
        g(X[:2])


# ---------------------------------------------------------------- what fuse leaves intact
def test_cond_while_custom_vjp_left_intact_and_correct():
    @jax.custom_vjp
    def clip_grad(x):
        return jnp.sin(x) * 2.0

    clip_grad.defvjp(
        lambda x: (clip_grad(x), x), lambda x, g: (jnp.clip(g * 2 * jnp.cos(x), -1, 1),)
    )

    def f(x):
        h = jnp.exp(jnp.sin(x)) * x
        h = lax.cond(h.sum() > 0, lambda h: jnp.tanh(h) * h, lambda h: jnp.cos(h) * h, h)
        h = clip_grad(h) * jnp.cos(h)
        return jnp.sum(h * h)

    g = cannjax.fuse(f)
    close(g(X), f(X), "float32")
    close(jax.grad(g)(X), jax.grad(f)(X), "float32")
    plan, _ = g.fusion_plan(X)
    kept = {k.primitive: k.reason for k in plan.kept}
    assert "cond" in kept and "custom_vjp_call" in kept
    assert len(plan.fused) >= 2

    def loop(x):  # while: forward only (as in plain JAX)
        y = lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.sin(c[0]) * 1.1, c[1] + 1), (x, 0))[0]
        return jnp.exp(y) * jnp.tanh(y)

    close(cannjax.fuse(loop)(X), loop(X), "float32")
    close(jax.jvp(cannjax.fuse(loop), (X,), (X,)), jax.jvp(loop, (X,), (X,)), "float32")


def test_value_dependent_python_control_flow_runs_unfused():
    def f(x):
        if float(x.sum()) > 0:  # needs a concrete value: cannot be traced abstractly
            return jnp.sin(jnp.exp(x))
        return x

    g = cannjax.fuse(f)
    close(g(X), f(X), "float32")
    plan, reason = g.fusion_plan(X)
    assert plan is None and "concrete" in reason


@pytest.mark.parametrize("transform", [cannjax.fuse, cannjax.optimize])
def test_python_numbers_are_static_in_fuse_and_optimize(transform):
    # One front end: code may branch on a Python number; each value is its own signature.
    def f(x, p):
        return jnp.sin(jnp.exp(x)) * p if p > 0 else jnp.tanh(x) * jnp.exp(x)

    traces = []
    g = transform(lambda x, p: traces.append(p) or f(x, p))
    for p in (0.5, -0.5, 0.5):
        close(g(X, p), f(X, p), "float32")
        grad = jax.grad(lambda x, p=p: g(x, p).sum())(X)
        close(grad, jax.grad(lambda x, p=p: f(x, p).sum())(X), "float32")
    assert sorted(traces) == [-0.5, 0.5]  # traced once per value, under grad too


# ---------------------------------------------------------------- bad input
def test_bad_input():
    with pytest.raises(TypeError, match=r"cannjax.fuse: fun must be callable, got int"):
        cannjax.fuse(3)
    with pytest.raises(ValueError, match=r"cannjax.fuse: level must be one of .*'fast'"):
        cannjax.fuse(jnp.sin, level="fast")
    with pytest.raises(ValueError, match=r"cannjax.fuse: min_ops must be >= 1, got 0"):
        cannjax.fuse(jnp.sin, min_ops=0)
    with pytest.raises(TypeError, match=r"cannjax.fuse: min_ops must be an int"):
        cannjax.fuse(jnp.sin, min_ops=2.5)


def test_wraps_and_min_ops():
    g = cannjax.fuse(chain5)
    assert g.__name__ == "chain5" and g.__wrapped__ is chain5
    loss = lambda x: sin_exp(x).sum()  # noqa: E731
    # a cluster of two math ops is not fused when min_ops=3
    assert residuals(cannjax.fuse(loss, min_ops=3), X).count == 2
    assert residuals(cannjax.fuse(loss, min_ops=1), X).count == 1


def test_fuse_as_a_decorator_with_and_without_options():
    def act(h):
        return jnp.tanh(h) * jax.nn.sigmoid(h) + 0.1 * h

    @cannjax.fuse(level="recompute", min_ops=1)
    def dec(h):
        return act(h)

    @cannjax.fuse
    def plain(h):
        return act(h)

    direct = cannjax.fuse(act, level="recompute", min_ops=1)
    assert dec.fuse_options == direct.fuse_options == {"level": "recompute", "min_ops": 1}
    assert plain.fuse_options == cannjax.fuse(act).fuse_options
    assert dec.__name__ == "dec" and plain.__name__ == "plain"
    x = jnp.linspace(-2.0, 2.0, 7)
    chex.assert_trees_all_close(
        jax.grad(lambda h: dec(h).sum())(x), jax.grad(lambda h: act(h).sum())(x)
    )
    assert [r.op for r in residuals(lambda h: dec(h).sum(), x).rows] == [
        r.op for r in residuals(lambda h: direct(h).sum(), x).rows
    ]
    with pytest.raises(ValueError, match="cannjax.fuse: level must be one of"):
        cannjax.fuse(level="nope")(act)


# ------------------------------------------------------------------ the fusion report's rendering
def test_fusion_report_prints_aligned_with_short_lines():
    def two_lines(x):
        y = jnp.exp(x)
        return jnp.sin(y).sum()

    x = jnp.linspace(-1.0, 1.0, 8)
    rep = cannjax.inspect.fusion(two_lines, x)
    text = str(rep)
    head, *rows = table_cells(text.rsplit("\n", 1)[0])
    assert head == ["where", "kind", "what", "saved", "line", "reason"]
    (fused,) = [r for r in rows if r[1] == "fused"]
    assert fused[:4] == ["top", "fused", "exp sin", "d float32[8] (derivative)"]
    m = re.fullmatch(
        r"test_fuse\.py:(\d+) \(two_lines\); test_fuse\.py:(\d+) \(two_lines\)", fused[4]
    )
    assert m and int(m[2]) == int(m[1]) + 1, fused[4]
    assert "/" not in text and not re.search(r"\.py:\d+:\d+", text)
    assert text.endswith("\n1 fused clusters, 1 equations kept")
    assert repr(rep) == text  # a REPL shows the table, as print does
    # One line, two columns: one location once.
    rep = cannjax.inspect.fusion(lambda x: jnp.sin(jnp.exp(x)).sum(), x)
    (fused,) = rep.fused
    cells = table_cells(str(rep).rsplit("\n", 1)[0])
    assert re.fullmatch(r"test_fuse\.py:\d+ \(<lambda>\)", cells[1][4]), cells
    assert fused.line.count("test_fuse.py") == 2  # the data keeps JAX's full locations


def test_fusion_report_html_is_an_escaped_table():
    rep = cannjax.inspect.fusion(lambda x: jnp.sin(jnp.exp(x)).sum(), jnp.ones(4))
    page = rep._repr_html_()
    assert page.startswith("<table><caption>1 fused clusters, 1 equations kept</caption>")
    assert page.count("<tr") == 3 and "<th>saved</th>" in page
    assert "(&lt;lambda&gt;)" in page and "<lambda>" not in page
