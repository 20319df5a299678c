"""Rematerialization: schedules, recomputation counts, compiled memory, policies, planner."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
from cannjax.core import defop
from cannjax.remat import policies, revolve
from tests import _rng as rand

SCHEDULES = [
    ("none", None),
    ("every", None),
    ("sqrt", None),
    ("sqrt", 3),
    ("binomial", None),
    ("binomial", 1),
    ("binomial", 2),
    ("binomial", 50),
]


def _body(h, x):
    """A pytree carry and pytree ys; uses a cannjax op and a closed-over weight."""
    a, b = h
    a = cannjax.ops.tanh(a @ x["w"] + b[None])
    b = b * 0.9 + jnp.sum(a, axis=0) * x["s"]
    return (a, b), {"mean": a.mean(), "a": a[0] * 2.0}


def _inputs(n=11, w=6, key=0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(key), 3)
    xs = {"w": rand.normal(k1, (n, w, w)) / w**0.5, "s": jnp.linspace(0.1, 1.0, n)}
    h = (rand.normal(k2, (3, w)), rand.normal(k3, (w,)) * 0.1)
    return h, xs


def _loss(h, xs, schedule, checkpoints):
    (a, b), ys = cannjax.remat.checkpointed_scan(
        _body, h, xs, schedule=schedule, checkpoints=checkpoints
    )
    return jnp.sum(a**2) + jnp.sum(b) + jnp.sum(ys["mean"]) + jnp.sum(ys["a"] ** 3)


# ---------------------------------------------------------------- Revolve arithmetic
@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 25])
@pytest.mark.parametrize("c", [1, 2, 3, 6])
def test_closed_form_equals_dynamic_programming_and_schedule(n, c):
    t = revolve.advances(n, c)
    assert t == revolve.advances_dp(n, c)
    assert revolve.schedule(n, c).advances == t


def test_known_revolve_figures():
    # r = 2 regime: t = 2n - c - 2; one checkpoint: n (n - 1) / 2; c >= n - 1: n - 1.
    assert revolve.advances(64, 10) == 2 * 64 - 10 - 2
    assert revolve.advances(10, 1) == 45
    assert revolve.advances(10, 9) == 9
    assert revolve.default_checkpoints(64) == 10  # (11 * 12) / 2 = 66 >= 64 > 55


# ---------------------------------------------------------------- semantics
@pytest.mark.parametrize("schedule,checkpoints", SCHEDULES)
def test_values_and_gradients_match_plain_scan(schedule, checkpoints):
    h, xs = _inputs()
    out = cannjax.remat.checkpointed_scan(_body, h, xs, schedule=schedule, checkpoints=checkpoints)
    ref = jax.lax.scan(_body, h, xs)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    grad = jax.jit(jax.grad(_loss, (0, 1)), static_argnums=(2, 3))
    g = grad(h, xs, schedule, checkpoints)
    g_ref = grad(h, xs, "none", None)
    # Eleven tanh steps amplify float32 rounding (gradients up to ~200): the recomputed
    # forward, fused differently, may differ from the saved one in the last bits, so the
    # absolute tolerance is relative to each gradient's scale.
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        scale = max(1.0, float(np.max(np.abs(b))))
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * scale)


@pytest.mark.parametrize("schedule", ["sqrt", pytest.param("binomial", marks=pytest.mark.extended)])
def test_forward_mode_vmap_and_nesting(schedule):
    h, xs = _inputs(n=7)

    def f(scale):
        h2 = jax.tree.map(lambda v: v * scale, h)
        return _loss(h2, xs, schedule, 2)

    def f_ref(scale):
        h2 = jax.tree.map(lambda v: v * scale, h)
        return _loss(h2, xs, "none", None)

    np.testing.assert_allclose(
        jax.jvp(f, (1.1,), (1.0,))[1], jax.jvp(f_ref, (1.1,), (1.0,))[1], rtol=1e-5
    )
    scales = jnp.array([0.5, 1.0, 1.5])
    np.testing.assert_allclose(
        jax.vmap(jax.grad(f))(scales), jax.vmap(jax.grad(f_ref))(scales), rtol=1e-5
    )
    if schedule == "binomial":  # second order through the Revolve operator
        np.testing.assert_allclose(jax.hessian(f)(1.1), jax.hessian(f_ref)(1.1), rtol=1e-4)

    def nested(xs, sched):
        def outer(h, _):
            return cannjax.remat.checkpointed_scan(_body, h, xs, schedule=sched, checkpoints=2)[
                0
            ], None

        return jnp.sum(jax.lax.scan(outer, h, None, length=3)[0][0])

    g = jax.jit(jax.grad(nested), static_argnums=1)
    for a, b in zip(jax.tree.leaves(g(xs, schedule)), jax.tree.leaves(g(xs, "none"))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_integer_xs_and_closed_over_values_are_handled():
    idx = jnp.arange(9) % 3
    table = jnp.linspace(0.5, 1.5, 3)

    def body(h, i):
        return jnp.sin(h * table[i]), h.sum()

    def loss(h, table_scale, schedule):
        def b(h, i):
            return jnp.sin(h * table[i] * table_scale), h.sum()

        h, ys = cannjax.remat.checkpointed_scan(b, h, idx, schedule=schedule, checkpoints=2)
        return h.sum() + ys.sum()

    g = jax.grad(loss, (0, 1))(jnp.ones(3), 1.2, "binomial")
    g_ref = jax.grad(loss, (0, 1))(jnp.ones(3), 1.2, "none")
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5)


# ---------------------------------------------------------------- recomputation counts
@pytest.mark.parametrize(
    "n,c",
    [(20, 3), (13, 1), (16, 5), (8, 10)],
)
def test_binomial_recomputation_equals_revolve_optimum(n, c):
    calls = []

    def body(h, w):
        jax.debug.callback(lambda: calls.append(1))
        return jnp.tanh(h @ w), None

    ws = jnp.full((n, 4, 4), 0.1)
    grad = jax.jit(
        jax.grad(
            lambda ws: cannjax.remat.checkpointed_scan(body, jnp.ones(4), ws, checkpoints=c)[
                0
            ].sum()
        )
    )
    jax.block_until_ready(grad(ws))
    calls.clear()
    jax.block_until_ready(grad(ws))
    # n forward steps, the backward's advances t(n, c) - (n - 1), n taped steps.
    assert len(calls) == n + 1 + revolve.advances(n, c)


# ---------------------------------------------------------------- compiled memory
def _temp(schedule, checkpoints, n=32, batch=64, width=32):
    ws = jnp.full((n, width, width), 0.01)
    x = jnp.ones((batch, width))

    def loss(ws, x):
        body = lambda h, w: (h + jnp.tanh(h @ w), None)  # noqa: E731
        h, _ = cannjax.remat.checkpointed_scan(
            body, x, ws, schedule=schedule, checkpoints=checkpoints
        )
        return jnp.sum(h**2)

    return cannjax.inspect.memory(loss, ws, x).temp_bytes


def test_compiled_memory_is_bounded_by_checkpoints():
    carry = 64 * 32 * 4
    none, every = _temp("none", None), _temp("every", None)
    b1, b2, b6 = _temp("binomial", 1), _temp("binomial", 2), _temp("binomial", 6)
    # The plain scan keeps two activations per step; "every" one carry per step.
    assert none >= 2 * 32 * carry
    assert 32 * carry <= every < none
    # Each checkpoint costs exactly one carry after compilation.
    assert b6 - b2 == 4 * carry and carry <= b2 - b1 <= carry + 512
    assert b6 < every / 3
    assert _temp("sqrt", None) < none / 2


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        ({"checkpoints": 0}, ValueError, "checkpoints must be >= 1.*got 0"),
        ({"checkpoints": -2}, ValueError, "got -2"),
        ({"checkpoints": 2.5}, TypeError, "checkpoints must be an int"),
        ({"checkpoints": True}, TypeError, "checkpoints must be an int"),
        ({"schedule": "treeverse"}, ValueError, "schedule must be one of.*'treeverse'"),
        ({"length": 5}, ValueError, "length=5"),
    ],
)
def test_bad_arguments(kwargs, err, match):
    with pytest.raises(err, match="cannjax.remat.checkpointed_scan: .*" + match):
        cannjax.remat.checkpointed_scan(
            lambda h, x: (h + x, None), jnp.zeros(2), jnp.ones((4, 2)), **kwargs
        )


def test_mismatched_leading_axes_and_integer_carry():
    xs = {"a": jnp.ones((4, 2)), "b": jnp.ones((5, 2))}
    with pytest.raises(ValueError, match=r"leading axes of xs.*\['a'\]: 4.*\['b'\]: 5"):
        cannjax.remat.checkpointed_scan(lambda h, x: (h, None), jnp.zeros(2), xs)
    with pytest.raises(TypeError, match="binomial' needs floating-point carry.*int32"):
        cannjax.remat.checkpointed_scan(
            lambda h, x: (h + 1, None), jnp.zeros(2, jnp.int32), None, length=4
        )
    with pytest.raises(TypeError, match="f must be callable"):
        cannjax.remat.checkpointed_scan(3, jnp.zeros(2), None, length=4)


# ---------------------------------------------------------------- policies
def _layer_norm():
    def forward(x):
        mean = x.mean(-1, keepdims=True)
        rstd = jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
        return (x - mean) * rstd, {"mean": mean, "rstd": rstd, "x": x}

    def backward(res, g):
        xh = (res["x"] - res["mean"]) * res["rstd"]
        gm = g.mean(-1, keepdims=True)
        return (res["rstd"] * (g - gm - xh * (g * xh).mean(-1, keepdims=True)),)

    def tangent(res, t):
        return backward(res, t)[0]  # self-adjoint projection

    return defop("test_layer_norm", forward=forward, tangent=tangent, backward=backward)


def test_policies_select_named_residuals():
    ln = _layer_norm()

    def f(x):
        return cannjax.ops.exp(cannjax.ops.sin(ln(x))).sum()

    x = rand.normal(jax.random.PRNGKey(0), (4, 8))

    def kept(policy):
        g = cannjax.remat.checkpoint(f, policy=policy)
        np.testing.assert_allclose(jax.grad(g)(x), jax.grad(f)(x), rtol=1e-5)
        rows = cannjax.inspect.residuals(g, x).rows
        return sorted(re.search(r"named '([^']+)'", r.source).group(1) for r in rows if r.op)

    assert kept(policies.save_statistics) == [
        "cannjax.test_layer_norm.mean",
        "cannjax.test_layer_norm.rstd",
    ]
    assert kept(policies.save_ops("exp")) == ["cannjax.exp.out"]
    assert kept(policies.nothing_saveable) == []
    assert kept(policies.save_names("cannjax.test_*.rstd")) == ["cannjax.test_layer_norm.rstd"]
    both = policies.any_of(policies.save_ops("exp"), policies.save_statistics)
    assert len(kept(both)) == 3
    # Elementwise ops' residuals go, the normalization's stay.
    assert all("test_layer_norm" in k for k in kept(policies.save_all_but_elementwise))
    # Every operator's named residuals stay; only unnamed values between them go.
    assert kept(policies.save_operator_residuals) == [
        "cannjax.exp.out",
        "cannjax.test_layer_norm.mean",
        "cannjax.test_layer_norm.rstd",
    ]


def test_save_operator_residuals_recomputes_between_operators_only():
    # A norm and the dense layer that reads it under one checkpoint: the norm's output
    # (the dense layer's input, unnamed) is recomputed; a gated MLP's pre-activations
    # (named residuals of swiglu) are kept, so no product runs twice.
    x = rand.normal(jax.random.key(0), (16, 8))
    s = jnp.ones(8)
    w = rand.normal(jax.random.key(1), (8, 4))
    wg, wu, wd = (rand.normal(jax.random.key(i), sh) for i, sh in
                  ((2, (8, 12)), (3, (8, 12)), (4, (12, 8))))  # fmt: skip

    def f(x, s, w, wg, wu, wd):
        a = cannjax.ops.rms_norm(x, s)
        return cannjax.ops.linear(a, w).sum() + cannjax.ops.swiglu(a, wg, wu, wd).sum()

    def shapes(policy):
        g = jax.checkpoint(f, policy=policy)
        grads = jax.grad(g, argnums=range(6))(x, s, w, wg, wu, wd)
        for a, b in zip(grads, jax.grad(f, argnums=range(6))(x, s, w, wg, wu, wd)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        rows = cannjax.inspect.residuals(g, x, s, w, wg, wu, wd).rows
        return sorted(r.shape for r in rows)

    ours = shapes(policies.save_operator_residuals)
    everything, nothing = shapes(policies.everything_saveable), shapes(policies.nothing_saveable)
    assert ours.count((16, 12)) == 2  # swiglu's x @ w_gate and x @ w_up, kept
    assert nothing.count((16, 12)) == 0  # (nothing_saveable recomputes them)
    assert ours.count((16, 8)) == 1  # x alone: rms_norm(x) is recomputed
    assert everything.count((16, 8)) == 2


def test_save_dots_keeps_matmul_outputs_only():
    w = jnp.ones((8, 8)) * 0.1

    def f(x):
        return jnp.sum(jnp.sin(jnp.tanh(x @ w) @ w))

    g = cannjax.remat.checkpoint(f, policy=policies.save_dots)
    srcs = [r.source for r in cannjax.inspect.residuals(g, jnp.ones((2, 8))).rows]
    assert any("dot_general" in s for s in srcs) and not any("tanh" in s for s in srcs)


def test_policy_and_checkpoint_errors():
    with pytest.raises(TypeError, match="cannjax.remat.checkpoint: policy must be callable"):
        cannjax.remat.checkpoint(jnp.sin, policy="dots")
    with pytest.raises(TypeError, match="cannjax.remat.checkpoint: fun must be callable"):
        cannjax.remat.checkpoint(None)
    with pytest.raises(TypeError, match="save_ops: ops must be names"):
        policies.save_ops("cannjax.exp")


# ---------------------------------------------------------------- planner
def _scan_problem(n=12, batch=32, width=16):
    ws = rand.normal(jax.random.PRNGKey(1), (n, width, width)) / width**0.5
    return (lambda h, w: (h + jnp.tanh(h @ w), None)), jnp.ones((batch, width)), ws


@pytest.mark.slow
@pytest.mark.extended  # long; make test-extended (CI) runs it
def test_scan_plan_stays_within_budget_and_beats_every():
    body, h, ws = _scan_problem()
    top = cannjax.remat.plan(body, h, ws, budget=10**9)
    assert top.schedule == "none" and top.recompute_flops == 0
    lo, hi = top.minimum_bytes, top.no_remat_bytes
    every = _temp_of(body, h, ws, "every", None)
    step_flops = jax.jit(body).lower(h, ws[0]).compile().cost_analysis()["flops"]
    assert lo < every < hi
    for budget in (lo, (lo + every) // 2, every):
        p = cannjax.remat.plan(body, h, ws, budget=int(budget))
        measured = _temp_of(body, h, ws, p.schedule, p.checkpoints)
        assert measured == p.compiled_bytes <= budget
        if budget >= every:  # never more recomputation than "every" when it fits
            assert p.recompute_flops <= len(ws) * step_flops
            assert p.schedule == "every"  # same recomputation as sqrt, faster
        g = jax.grad(lambda h, p=p: jnp.sum(p(h, ws)[0] ** 2))(h)
        g_ref = jax.grad(lambda h: jnp.sum(jax.lax.scan(body, h, ws)[0] ** 2))(h)
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=f"below the feasible minimum of {lo} bytes"):
        cannjax.remat.plan(body, h, ws, budget=lo - 1)


def _temp_of(body, h, ws, schedule, c):
    def loss(h, ws):
        return jnp.sum(
            cannjax.remat.checkpointed_scan(body, h, ws, schedule=schedule, checkpoints=c)[0] ** 2
        )

    return cannjax.inspect.compiled_memory(jax.grad(loss, (0, 1)), h, ws).temp_bytes


def _chain(n=6, batch=64):
    widths = [32 + 8 * (i % 3) for i in range(n + 1)]
    keys = jax.random.split(jax.random.PRNGKey(2), n)
    params = [rand.normal(k, (a, b)) / a**0.5 for k, a, b in zip(keys, widths, widths[1:])]
    layers = [
        (lambda p, x: jnp.tanh(x @ p) * jax.nn.sigmoid(x @ p))
        if i % 2
        else (lambda p, x: jnp.sin(jnp.tanh(x @ p)))
        for i in range(n)
    ]
    return layers, params, jnp.ones((batch, widths[0]))


@pytest.mark.slow
@pytest.mark.extended  # long; make test-extended (CI) runs it
def test_chain_plan_stays_within_budget_with_exact_gradients():
    layers, params, x = _chain()
    top = cannjax.remat.plan(layers, params, x, budget=10**9)
    assert top.recompute_flops == 0 and not any(r for _, _, r in top.segments)
    lo, hi = top.minimum_bytes, top.no_remat_bytes
    assert lo < 0.75 * hi
    ref = jax.grad(lambda p: jnp.sum(cannjax.remat.plan(layers, p, x, budget=10**9)(p, x) ** 2))
    g_ref = ref(params)
    last_flops = None
    for budget in np.linspace(lo, hi, 3).astype(int):
        p = cannjax.remat.plan(layers, params, x, budget=int(budget))
        assert p.compiled_bytes <= budget
        if last_flops is not None:  # more memory never costs more recomputation
            assert p.recompute_flops <= last_flops
        last_flops = p.recompute_flops
        g = jax.grad(lambda q, p=p: jnp.sum(p(q, x) ** 2))(params)
        for a, b in zip(g, g_ref):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="cannjax.remat.plan: budget=.*feasible minimum"):
        cannjax.remat.plan(layers, params, x, budget=lo - 1)


def test_plan_bad_input():
    layers, params, x = _chain(n=2)
    with pytest.raises(TypeError, match="cannjax.remat.plan: budget must be an int"):
        cannjax.remat.plan(layers, params, x, budget=1.5)
    with pytest.raises(ValueError, match="cannjax.remat.plan: budget must be > 0"):
        cannjax.remat.plan(layers, params, x, budget=0)
    with pytest.raises(ValueError, match="one entry per layer"):
        cannjax.remat.plan(layers, params[:1], x, budget=10**6)
    with pytest.raises(TypeError, match="chain must be a scan body"):
        cannjax.remat.plan([1, 2], params, x, budget=10**6)


def test_no_xs_with_length_and_empty_scan():
    def run(s, schedule):
        body = lambda h, _: (jnp.sin(h) * s, h.sum())  # noqa: E731
        return cannjax.remat.checkpointed_scan(body, jnp.ones(3), None, length=9, schedule=schedule)

    g = jax.grad(lambda s: run(s, "binomial")[1].sum())(1.1)
    g_ref = jax.grad(lambda s: run(s, "none")[1].sum())(1.1)
    np.testing.assert_allclose(g, g_ref, rtol=1e-6)
    h, ys = cannjax.remat.checkpointed_scan(lambda h, x: (h + x, x), jnp.zeros(2), jnp.ones((0, 2)))
    assert ys.shape == (0, 2) and float(h.sum()) == 0.0


def test_checkpoint_as_a_decorator_with_and_without_options():
    def f(x):
        return cannjax.ops.exp(cannjax.ops.tanh(x)).sum()

    @cannjax.remat.checkpoint(policy=policies.nothing_saveable)
    def dec(x):
        return f(x)

    @cannjax.remat.checkpoint
    def plain(x):
        return f(x)

    x = jnp.linspace(-1.0, 1.0, 5)
    direct = cannjax.remat.checkpoint(f, policy=policies.nothing_saveable)
    assert dec.__name__ == "dec"
    np.testing.assert_allclose(jax.grad(dec)(x), jax.grad(f)(x), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(plain)(x), jax.grad(f)(x), rtol=1e-6)
    # the policy took effect: only the input is kept, as for the direct call
    assert cannjax.inspect.residuals(dec, x).count == cannjax.inspect.residuals(direct, x).count
    assert cannjax.inspect.residuals(dec, x).count == 1
    with pytest.raises(TypeError, match="policy must be callable or None"):
        cannjax.remat.checkpoint(policy="nothing")(f)


# ---------------------------------------------------------------- pytrees, vmap, jit
def _tree_body(carry, x):
    """A dict carry, tuple xs, and ys holding a nested tuple and a None."""
    w, s = x
    h = jnp.tanh(carry["h"] @ w) * s
    acc = carry["acc"] + h.sum(axis=0)
    return {"h": h, "acc": acc}, ((h[0], acc.mean()), None)


def _tree_inputs(n=7, w=5):
    k1, k2 = jax.random.split(jax.random.key(3))
    init = {"h": rand.normal(k1, (2, w)), "acc": jnp.zeros(w)}
    xs = (rand.normal(k2, (n, w, w)) / w**0.5, jnp.linspace(0.5, 1.5, n))
    return init, xs


# The Revolve operator and the nested sqrt scans run in make test; the schedules that
# are lax.scan and jax.checkpoint as they are, in make test-extended.
_OURS_FIRST = [
    "binomial",
    "sqrt",
    pytest.param("every", marks=pytest.mark.extended),
]


@pytest.mark.parametrize(
    "schedule", [*_OURS_FIRST, pytest.param("none", marks=pytest.mark.extended)]
)
def test_pytree_carry_xs_and_ys_match_lax_scan(schedule):
    init, xs = _tree_inputs()

    def loss(init, xs, schedule):
        scan = cannjax.remat.checkpointed_scan
        carry, ((first, mean), none) = scan(_tree_body, init, xs, schedule=schedule, checkpoints=2)
        assert none is None
        return jnp.sum(carry["h"] ** 2) + jnp.sum(carry["acc"]) + jnp.sum(first * mean[:, None])

    out = cannjax.remat.checkpointed_scan(_tree_body, init, xs, schedule=schedule, checkpoints=2)
    ref = jax.lax.scan(_tree_body, init, xs)
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    grad = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)
    g, g_ref = grad(init, xs, schedule), grad(init, xs, "none")
    assert jax.tree.structure(g) == jax.tree.structure(g_ref)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def _vmap_loss(h0, ws, scale, schedule):
    body = lambda h, w: (jnp.tanh(h @ w) * scale, h.sum())  # noqa: E731 -- closes over scale
    h, ys = cannjax.remat.checkpointed_scan(body, h0, ws, schedule=schedule, checkpoints=2)
    return jnp.sum(h**2) + jnp.sum(ys)


@pytest.mark.parametrize(
    "schedule,in_axes",
    [
        ("binomial", (0, 0, 0)),
        ("binomial", (None, 0, None)),
        ("binomial", (0, None, None)),
        ("sqrt", (None, 0, None)),
        *(
            pytest.param(s, ax, marks=pytest.mark.extended)
            for s, ax in [
                ("sqrt", (0, 0, 0)),
                ("sqrt", (0, None, None)),
                ("every", (0, 0, 0)),
                ("every", (None, 0, None)),
                ("every", (0, None, None)),
            ]
        ),
    ],
)
def test_per_example_gradients_under_jit_of_vmap(schedule, in_axes):
    # Batched xs with an unbatched carry makes the carry batched after the first step;
    # a batched closed-over scale reaches the Revolve operator as a batched constant.
    b, n, w = 3, 6, 4
    k1, k2 = jax.random.split(jax.random.key(4))
    h0 = rand.normal(k1, (b, w))
    ws = rand.normal(k2, (b, n, w, w)) / w
    scale = jnp.linspace(0.8, 1.2, b)
    args = [a if ax == 0 else a[0] for a, ax in zip((h0, ws, scale), in_axes)]

    def per_example(schedule):
        grad = jax.grad(_vmap_loss, (0, 1, 2))
        return jax.jit(jax.vmap(lambda *a: grad(*a, schedule), in_axes=in_axes))(*args)

    for a, r in zip(per_example(schedule), per_example("none")):
        np.testing.assert_allclose(a, r, rtol=2e-5, atol=2e-6)


def test_jit_of_the_scan_itself_with_length_and_no_xs():
    body = lambda h, _: (jnp.sin(h) + 0.1, h.sum())  # noqa: E731
    run = jax.jit(
        lambda h: cannjax.remat.checkpointed_scan(body, h, None, length=9, checkpoints=np.int32(3))
    )
    h, ys = run(jnp.ones(3))
    h_ref, ys_ref = jax.lax.scan(body, jnp.ones(3), None, length=9)
    np.testing.assert_allclose(h, h_ref, rtol=1e-6)
    np.testing.assert_allclose(ys, ys_ref, rtol=1e-6)
    assert ys.shape == (9,)


# ---------------------------------------------------------------- bad bodies and xs
@pytest.mark.parametrize("schedule", cannjax.remat.SCHEDULES)
@pytest.mark.parametrize(
    "body,match",
    [
        (lambda h, w: (h.sum(), None), "shapes do not match"),
        (lambda h, w: (h.astype(jnp.float16), None), "dtypes do not match"),
        (lambda h, w: ((h, h), None), "same pytree structure"),
        (lambda h, w: h, "must be a pair"),
    ],
    ids=["shape", "dtype", "structure", "not-a-pair"],
)
def test_a_body_that_changes_the_carry_is_a_named_error(schedule, body, match):
    # Before the fix: lax.scan's TypeError, naming neither checkpointed_scan nor f.
    with pytest.raises(TypeError) as info:
        cannjax.remat.checkpointed_scan(
            body, jnp.ones((2, 3)), jnp.ones((5, 3, 3)), schedule=schedule
        )
    message = str(info.value)
    assert message.startswith(
        "cannjax.remat.checkpointed_scan: f(carry, x) must return a pair (new_carry, y), "
        "new_carry with the structure, shapes and dtypes of init; scan body"
    )
    assert match in message


def test_an_error_raised_by_the_body_itself_is_left_as_it_is():
    def body(h, x):
        raise TypeError("my own error")

    with pytest.raises(TypeError, match="^my own error"):
        cannjax.remat.checkpointed_scan(body, jnp.ones(2), jnp.ones((4, 2)))


@pytest.mark.parametrize(
    "xs,kwargs,match",
    [
        ({"w": jnp.ones((4, 2)), "b": jnp.float32(1.0)}, {}, r"xs\['b'\] is a scalar"),
        (None, {}, "give length when xs is None"),
        (None, {"length": True}, "length must be an int >= 0, got True"),
        (None, {"length": 2.0}, "length must be an int >= 0, got 2.0"),
        ((jnp.ones((4, 2)), jnp.ones((3, 2))), {}, r"xs\[0\]: 4, xs\[1\]: 3"),
    ],
)
def test_bad_xs_and_length_name_the_function_and_argument(xs, kwargs, match):
    with pytest.raises(ValueError, match="cannjax.remat.checkpointed_scan: .*" + match):
        cannjax.remat.checkpointed_scan(lambda h, x: (h, None), jnp.zeros(2), xs, **kwargs)


def test_plan_repr_is_its_summary_line():
    kib = 2**10
    p = cannjax.remat.Plan(
        kind="scan", budget=1024 * kib, predicted_bytes=600 * kib, compiled_bytes=512 * kib,
        minimum_bytes=256 * kib, no_remat_bytes=3072 * kib, recompute_flops=50.0,
        gradient_flops=100.0, schedule="binomial", checkpoints=4,
    )  # fmt: skip
    line = (
        "Plan(schedule='binomial', checkpoints=4): compiled 512.0 KiB (predicted 600.0 KiB) "
        "within budget 1.00 MiB; x1.50 gradient FLOPs; feasible 256.0 KiB..3.00 MiB"
    )
    assert repr(p) == str(p) == line
    chain = dataclasses.replace(
        p, kind="chain", schedule=None, checkpoints=None, segments=((0, 2, True), (2, 5, False))
    )
    assert repr(chain).startswith("Plan(recompute segments [0:2)): compiled 512.0 KiB")
