"""cannjax.remat.plan at the edges of its budget: a budget exactly equal to a plan's
compiled memory, one byte below it, zero, the feasible minimum, more than anything needs;
and its bad input. The sweep over every candidate of a scan is ``extended``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
from cannjax._src.remat import planner
from cannjax.remat import revolve
from tests import _rng as rand

# A scan whose compiled gradient memory grows with every binomial checkpoint (one carry
# of 16 x 16 float32 each, give or take alignment): n = 8 steps, so c in 1..6.
N, BATCH, WIDTH = 8, 16, 16


def _problem():
    ws = rand.normal(jax.random.key(1), (N, WIDTH, WIDTH)) / WIDTH**0.5
    return (lambda h, w: (h + jnp.tanh(h @ w), None)), jnp.ones((BATCH, WIDTH)), ws


def _compiled(body, h, ws, schedule, c):
    """Compiled temp bytes of the gradient the planner checks (default loss)."""

    def loss(h, ws):
        out = cannjax.remat.checkpointed_scan(body, h, ws, schedule=schedule, checkpoints=c)
        return jnp.sum(out[0] ** 2)

    return cannjax.inspect.compiled_memory(jax.grad(loss, (0, 1)), h, ws).temp_bytes


def _expected(table, budget):
    """The least-recomputation candidate of ``table`` that fits ``budget``, or None."""
    steps = {("none", None): 0, ("every", None): N}
    steps.update({k: N for k in table if k[0] == "sqrt"})
    steps.update({k: revolve.advances(N, k[1]) + 1 for k in table if k[0] == "binomial"})
    order = {"none": 0, "every": 1, "sqrt": 2, "binomial": 3}  # ties: every before sqrt
    fits = [k for k, b in table.items() if b <= budget]
    return min(fits, key=lambda k: (steps[k], order[k[0]]), default=None)


def _check_plan(body, h, ws, budget):
    p = cannjax.remat.plan(body, h, ws, budget=budget)
    assert p.kind == "scan" and p.compiled_bytes <= budget
    assert p.compiled_bytes == _compiled(body, h, ws, p.schedule, p.checkpoints)
    g = jax.grad(lambda h: jnp.sum(p(h, ws)[0] ** 2))(h)
    g_ref = jax.grad(lambda h: jnp.sum(jax.lax.scan(body, h, ws)[0] ** 2))(h)
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-6)
    return p


# ---------------------------------------------------------------- the binomial search
@pytest.mark.parametrize("guess", [-3, 1, 2, 4, 5, 6, 9])
def test_largest_fitting_finds_the_largest_c_within_the_budget_from_any_guess(guess):
    sizes = {c: 100 * c + (7 if c > 3 else 0) for c in range(1, 7)}  # increasing, not linear
    for budget in range(100, 700):
        calls = []

        def size(c, calls=calls):
            calls.append(c)
            return sizes[c]

        want = max(c for c, s in sizes.items() if s <= budget)
        assert planner._largest_fitting(size, budget, 6, guess) == want, (budget, guess)
        assert len(calls) == len(set(calls)) <= 5, calls  # never all six
        if abs(guess - want) <= 1 and 1 <= guess <= 6:
            assert len(calls) <= 3, calls  # a guess off by one costs three compilations


@pytest.mark.slow
def test_scan_plan_at_exactly_a_binomial_plans_compiled_memory():
    # Before the fix the linear fit (off by alignment) skipped the binomial plan whose
    # compiled memory equals the budget, and chose c = 3 (more recomputation).
    body, h, ws = _problem()
    budget = _compiled(body, h, ws, "binomial", 4)
    p = cannjax.remat.plan(body, h, ws, budget=np.int64(budget))
    assert (p.schedule, p.checkpoints) == ("binomial", 4)
    assert p.compiled_bytes == p.budget == budget and type(p.budget) is int
    assert p.recompute_flops > 0 and p.minimum_bytes < budget < p.no_remat_bytes


@pytest.mark.extended
def test_scan_plan_at_exactly_its_compiled_memory_and_one_byte_below():
    body, h, ws = _problem()
    top = cannjax.remat.plan(body, h, ws, budget=2**40)
    budget = top.minimum_bytes + (top.no_remat_bytes - top.minimum_bytes) // 4
    mid = _check_plan(body, h, ws, budget)
    assert mid.schedule == "binomial" and mid.checkpoints >= 3
    exact = _check_plan(body, h, ws, mid.compiled_bytes)
    assert (exact.schedule, exact.checkpoints) == (mid.schedule, mid.checkpoints)
    assert exact.compiled_bytes == exact.budget
    below = _check_plan(body, h, ws, mid.compiled_bytes - 1)
    assert below.schedule == "binomial" and below.checkpoints < mid.checkpoints
    assert below.recompute_flops > mid.recompute_flops


@pytest.mark.extended
def test_scan_plan_at_every_candidates_memory_and_one_byte_below():
    body, h, ws = _problem()
    sq = int(np.sqrt(N - 1)) + 1
    table = {("none", None): None, ("every", None): None, ("sqrt", sq): None}
    table.update({("binomial", c): None for c in range(1, N - 1)})
    table = {k: _compiled(body, h, ws, *k) for k in table}
    binomial = [table["binomial", c] for c in range(1, N - 1)]
    assert binomial == sorted(binomial) and len(set(binomial)) == len(binomial), table
    minimum = min(table.values())
    budgets = sorted({b + d for b in table.values() for d in (0, -1)} | {2**40})
    for budget in budgets:
        want = _expected(table, budget)
        if want is None:
            assert budget == minimum - 1
            with pytest.raises(ValueError, match=f"feasible minimum of {minimum} bytes"):
                cannjax.remat.plan(body, h, ws, budget=budget)
            continue
        p = cannjax.remat.plan(body, h, ws, budget=budget)
        assert (p.schedule, p.checkpoints) == want, (budget, table)
        assert p.compiled_bytes == table[want] <= budget
        assert p.minimum_bytes == minimum and p.no_remat_bytes == table["none", None]
        assert p.recompute_flops == 0 if want[0] == "none" else p.recompute_flops > 0


# ---------------------------------------------------------------- chains
def _chain(n=6, batch=64):
    widths = [32 + 8 * (i % 3) for i in range(n + 1)]
    keys = jax.random.split(jax.random.key(2), n)
    params = [rand.normal(k, (a, b)) / a**0.5 for k, a, b in zip(keys, widths, widths[1:])]
    layers = [
        (lambda p, x: jnp.tanh(x @ p) * jax.nn.sigmoid(x @ p))
        if i % 2
        else (lambda p, x: jnp.sin(jnp.tanh(x @ p)))
        for i in range(n)
    ]
    return layers, params, jnp.ones((batch, widths[0]))


@pytest.mark.extended
def test_chain_plan_at_its_boundaries():
    layers, params, x = _chain()
    top = cannjax.remat.plan(layers, params, x, budget=2**40)
    lo, hi = top.minimum_bytes, top.no_remat_bytes
    assert lo < hi and top.recompute_flops == 0
    keep = cannjax.remat.plan(layers, params, x, budget=hi)  # exactly the no-remat figure
    assert keep.segments == top.segments and not any(r for *_, r in keep.segments)
    below = cannjax.remat.plan(layers, params, x, budget=hi - 1)
    assert below.compiled_bytes <= hi - 1 and any(r for *_, r in below.segments)
    least = cannjax.remat.plan(layers, params, x, budget=lo)  # exactly the minimum
    assert least.compiled_bytes <= lo and least.recompute_flops >= below.recompute_flops
    # Halfway, a plan that recomputes less than the minimum's fits: before the fix the
    # planner stopped at the first plan that fitted, which was the minimum's.
    mid = cannjax.remat.plan(layers, params, x, budget=(lo + hi) // 2)
    assert mid.compiled_bytes <= (lo + hi) // 2
    assert below.recompute_flops <= mid.recompute_flops < least.recompute_flops
    with pytest.raises(ValueError, match=f"feasible minimum of {lo} bytes"):
        cannjax.remat.plan(layers, params, x, budget=lo - 1)
    g_ref = jax.grad(lambda ps: jnp.sum(top(ps, x) ** 2))(params)
    for p in (below, mid, least):
        g = jax.grad(lambda ps, p=p: jnp.sum(p(ps, x) ** 2))(params)
        for a, b in zip(g, g_ref):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- bad input and edges
@pytest.mark.parametrize(
    "budget,error,match",
    [
        (0, ValueError, "budget must be > 0 bytes, got 0"),
        (-1, ValueError, "budget must be > 0 bytes, got -1"),
        (True, TypeError, "budget must be an int number of bytes, got True"),
        (2.0**20, TypeError, "budget must be an int number of bytes, got 1048576.0"),
        ("1MiB", TypeError, "budget must be an int number of bytes, got '1MiB'"),
    ],
)
def test_bad_budgets_are_refused_before_compiling(budget, error, match):
    body, h, ws = _problem()
    with pytest.raises(error, match="cannjax.remat.plan: " + match):
        cannjax.remat.plan(body, h, ws, budget=budget)


def test_bad_scan_arguments_name_plan_and_the_argument():
    body, h, ws = _problem()
    # Before the fix: a ValueError naming checkpointed_scan and its length argument.
    with pytest.raises(ValueError, match=r"cannjax.remat.plan: xs must hold at least one array"):
        cannjax.remat.plan(body, h, None, budget=2**20)
    with pytest.raises(ValueError, match=r"cannjax.remat.plan: the leading axes of xs"):
        cannjax.remat.plan(body, h, {"a": ws, "b": ws[:2]}, budget=2**20)
    with pytest.raises(ValueError, match=r"cannjax.remat.plan: every leaf of xs needs a lead"):
        cannjax.remat.plan(body, h, (ws, jnp.float32(1.0)), budget=2**20)
    # Before the fix: TypeError: 'int' object is not callable, from inside jax.
    with pytest.raises(TypeError, match="cannjax.remat.plan: loss must be a callable.*got int"):
        cannjax.remat.plan(body, h, ws, budget=2**20, loss=3)
    with pytest.raises(ValueError, match=r"cannjax.remat.plan: a scanned body takes \(init, xs\)"):
        cannjax.remat.plan(body, h, budget=2**20)


def test_zero_steps_plan_keeps_nothing_to_recompute():
    # Before the fix: IndexError (the planner read the first step of an empty xs).
    body, h, ws = _problem()
    p = cannjax.remat.plan(body, h, ws[:0], budget=2**20)
    assert p.schedule == "none" and p.recompute_flops == 0 and p.compute_ratio == 1.0
    out, _ = p(h, ws[:0])
    np.testing.assert_array_equal(out, h)
    assert "x1.00 gradient FLOPs" in str(p)


@pytest.mark.extended
def test_a_custom_loss_is_the_one_checked():
    body, h, ws = _problem()
    p = cannjax.remat.plan(body, h, ws, budget=2**30, loss=lambda out: out[0][0].sum())
    assert p.schedule == "none"
    # The planner's own figure for this loss, which differs from the default's.
    loss = lambda h, ws: jax.lax.scan(body, h, ws)[0][0].sum()  # noqa: E731
    assert (
        p.compiled_bytes
        == cannjax.inspect.compiled_memory(jax.grad(loss, (0, 1)), h, ws).temp_bytes
    )
