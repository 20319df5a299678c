"""cannjax.dynamic: optimal gears, padding with weights, and the step compiled per gear."""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
import cannjax.models
from cannjax import dynamic
from cannjax._src.dynamic import gears as gears_module
from tests import _rng as rand

# ---------------------------------------------------------------------------------------
# Planning


def _brute_force(hist, k, cost, multiple, max_length):
    """The least padded cost over every allowed set of at most k gears."""
    top = max_length or -(-max(hist) // multiple) * multiple
    allowed = sorted({s for s in range(multiple, top + 1, multiple)} | {top})
    below = [s for s in allowed if s < top]
    best = np.inf
    for n in range(k):
        for rest in itertools.combinations(below, n):
            sizes = [*rest, top]
            total = sum(c * cost(min(s for s in sizes if s >= x)) for x, c in hist.items())
            best = min(best, total)
    return best


COSTS = {"linear": lambda n: n, "quadratic": lambda n: n * n, "affine": lambda n: 5 + 3 * n}


@pytest.mark.parametrize("cost", list(COSTS))
@pytest.mark.parametrize("multiple", [None, 3])
def test_plan_is_optimal_against_brute_force(cost, multiple):
    rng = np.random.default_rng(hash((cost, multiple)) % 2**32)
    for trial in range(25):
        xs = rng.choice(np.arange(1, 13), size=rng.integers(1, 8), replace=False)
        hist = {int(x): int(rng.integers(0, 6)) for x in xs}
        hist[int(xs[0])] += 1  # at least one length counts
        k = int(rng.integers(1, 5))
        max_length = 14 if trial % 3 == 0 else None
        model = cost if cost != "affine" else COSTS["affine"]
        g = dynamic.plan_gears(hist, k, cost=model, multiple=multiple, max_length=max_length)
        want = _brute_force(hist, k, COSTS[cost], multiple or 1, max_length)
        np.testing.assert_allclose(sum(g.padded_costs), want, rtol=1e-12)
        assert len(g.sizes) <= k
        top = max_length or -(-max(hist) // (multiple or 1)) * (multiple or 1)
        assert g.sizes[-1] == top
        assert all(s % (multiple or 1) == 0 or s == max_length for s in g.sizes)
        assert sum(g.counts) == sum(hist.values())


def test_plan_reports_its_cost():
    lengths = [10] * 50 + [12] * 30 + [60] * 15 + [64] * 5
    g = dynamic.plan_gears(lengths, 2)
    assert g.sizes == (12, 64) and g.counts == (80, 20)
    assert g.expected_cost == pytest.approx((80 * 12 + 20 * 64) / 100)
    unpadded = 50 * 10 + 30 * 12 + 15 * 60 + 5 * 64
    assert g.overhead == pytest.approx((80 * 12 + 20 * 64) / unpadded - 1)
    # The histogram, a NumPy array and a JAX array are the same input.
    for same in ({10: 50, 12: 30, 60: 15, 64: 5}, np.array(lengths), jnp.array(lengths)):
        assert dynamic.plan_gears(same, 2) == g


def test_plan_limits():
    lengths = [3, 5, 5, 9, 17]
    assert dynamic.plan_gears(lengths, 10).sizes == (3, 5, 9, 17)  # one gear per length
    assert dynamic.plan_gears(lengths, 10).overhead == 0
    assert dynamic.plan_gears(lengths, 1).sizes == (17,)
    assert dynamic.plan_gears(lengths, 1, multiple=16).sizes == (32,)
    assert dynamic.plan_gears(lengths, 2, max_length=40).sizes[-1] == 40
    overheads = [dynamic.plan_gears(lengths, k).overhead for k in range(1, 6)]
    assert overheads == sorted(overheads, reverse=True)


def test_platform_multiple(monkeypatch):
    assert dynamic.plan_gears([5, 20], 2, multiple="platform").sizes == (5, 20)  # CPU: 1
    ascend = cannjax.backend.facts("ascend")
    monkeypatch.setattr(gears_module, "facts", lambda: ascend)
    assert dynamic.plan_gears([5, 20], 2, multiple="platform").sizes == (16, 32)


def test_power_of_two_and_fixed_gears():
    lengths = {20: 10, 100: 5, 300: 1}
    assert dynamic.power_of_two_gears(lengths, 4).sizes == (64, 128, 256, 512)
    assert dynamic.power_of_two_gears(lengths, 10).sizes == (32, 64, 128, 256, 512)
    assert dynamic.power_of_two_gears([16, 512], 8).sizes == (16, 32, 64, 128, 256, 512)
    every = dynamic.fixed_gears([512], lengths)
    assert every.counts == (16,)
    assert every.overhead == pytest.approx(16 * 512 / (200 + 500 + 300) - 1)
    # On a skewed distribution the plan beats the powers of two with the same k.
    rng = np.random.default_rng(0)
    skewed = np.clip(np.round(rng.lognormal(np.log(64), 0.8, 1000)), 16, 512).astype(int)
    for k in (4, 8):
        dp, p2 = dynamic.plan_gears(skewed, k), dynamic.power_of_two_gears(skewed, k)
        assert dp.overhead < p2.overhead


def test_gears_table_and_gear_for():
    g = dynamic.plan_gears({10: 50, 12: 30, 60: 15, 64: 5}, 2)
    text = str(g)
    assert text.splitlines()[0].startswith("Gears: 2 sizes for 100 lengths, linear cost")
    assert "13-64" in text
    assert g._repr_html_().startswith("<table><caption>Gears: 2 sizes")
    assert [g.gear_for(n) for n in (1, 12, 13, 64)] == [12, 12, 64, 64]
    with pytest.raises(ValueError, match=r"Gears.gear_for: length 65 exceeds the largest gear 64"):
        g.gear_for(65)
    with pytest.raises(ValueError, match="length must be >= 1"):
        g.gear_for(0)
    with pytest.raises(TypeError, match="length must be an int"):
        g.gear_for(3.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.sizes = (1,)


BAD = [
    (dynamic.plan_gears, ([4, 8], 0), {}, ValueError, r"plan_gears: k must be >= 1, got 0"),
    (dynamic.plan_gears, ([4, 8], 2.0), {}, TypeError, r"plan_gears: k must be an int"),
    (dynamic.plan_gears, ([], 2), {}, ValueError, r"plan_gears: lengths is empty"),
    (dynamic.plan_gears, ({}, 2), {}, ValueError, r"plan_gears: lengths is empty"),
    (dynamic.plan_gears, ([4, 8.5], 2), {}, ValueError, r"plan_gears: lengths must hold"),
    (dynamic.plan_gears, ([4, 0], 2), {}, ValueError, r"plan_gears: lengths must hold positive"),
    (dynamic.plan_gears, (np.array([4.0]), 2), {}, ValueError, r"plan_gears: lengths must"),
    (dynamic.plan_gears, ([4, True], 2), {}, ValueError, r"plan_gears: lengths must hold"),
    (dynamic.plan_gears, ("48", 2), {}, TypeError, r"plan_gears: lengths must be a sequence"),
    (dynamic.plan_gears, (7, 2), {}, TypeError, r"plan_gears: lengths must be a sequence"),
    (dynamic.plan_gears, ({4: -1, 8: 2}, 2), {}, ValueError, r"plan_gears: lengths counts"),
    (dynamic.plan_gears, ({4: 0}, 2), {}, ValueError, r"plan_gears: lengths counts are all"),
    (dynamic.plan_gears, ([4], 2), {"cost": "cubic"}, ValueError, r"plan_gears: cost must be"),
    (dynamic.plan_gears, ([4], 2), {"cost": 3}, TypeError, r"plan_gears: cost must be"),
    (
        dynamic.plan_gears,
        ([4, 8], 2),
        {"cost": lambda n: -n},
        ValueError,
        r"plan_gears: cost must be finite and non-negative",
    ),
    (
        dynamic.plan_gears,
        ([4, 8], 2),
        {"cost": lambda n: 100 - n},
        ValueError,
        r"plan_gears: cost must be nondecreasing",
    ),
    (dynamic.plan_gears, ([4], 2), {"multiple": 0}, ValueError, r"plan_gears: multiple must"),
    (dynamic.plan_gears, ([4], 2), {"multiple": "ascend"}, ValueError, r"plan_gears: multiple"),
    (
        dynamic.plan_gears,
        ([4, 9], 2),
        {"max_length": 8},
        ValueError,
        r"plan_gears: length 9 exceeds max_len",
    ),
    (dynamic.power_of_two_gears, ([4], 0), {}, ValueError, r"power_of_two_gears: k must be"),
    (dynamic.power_of_two_gears, ([], 2), {}, ValueError, r"power_of_two_gears: lengths is"),
    (dynamic.power_of_two_gears, ([4], 1), {"cost": "x"}, ValueError, r"power_of_two_gears: cost"),
    (dynamic.fixed_gears, ([], [4]), {}, ValueError, r"fixed_gears: sizes is empty"),
    (dynamic.fixed_gears, ([4], [5]), {}, ValueError, r"fixed_gears: length 5 exceeds the larg"),
    (dynamic.fixed_gears, ([4], [2.5]), {}, ValueError, r"fixed_gears: lengths must hold"),
]


@pytest.mark.parametrize("fn,args,kwargs,exc,match", BAD)
def test_bad_input_names_the_function_and_argument(fn, args, kwargs, exc, match):
    with pytest.raises(exc, match=r"cannjax\.dynamic\." + match):
        fn(*args, **kwargs)


# ---------------------------------------------------------------------------------------
# Padding


def test_pad_to_gear_pytree_and_prefix_axes():
    batch = {
        "tokens": np.arange(6).reshape(2, 3),
        "emb": jnp.ones((2, 3, 4)),
        "meta": {"n": np.array([3, 3]), "tag": np.zeros((2, 7))},
    }
    padded, w = dynamic.pad_to_gear(batch, 5, axis={"tokens": 1, "emb": 1, "meta": None}, value=-1)
    np.testing.assert_array_equal(padded["tokens"], [[0, 1, 2, -1, -1], [3, 4, 5, -1, -1]])
    assert isinstance(padded["tokens"], np.ndarray)
    assert padded["emb"].shape == (2, 5, 4) and float(padded["emb"][:, 3:].max()) == -1
    assert padded["meta"]["tag"] is batch["meta"]["tag"]
    assert isinstance(w, jax.Array) and w.dtype == jnp.float32  # a JAX leaf was padded
    np.testing.assert_array_equal(w, [[1, 1, 1, 0, 0]] * 2)
    # A single int skips the leaves that lack the axis; a negative axis counts from the end.
    padded, w = dynamic.pad_to_gear({"t": np.ones((2, 3)), "n": np.array([1, 2])}, 4)
    assert padded["t"].shape == (2, 4) and padded["n"].shape == (2,)
    assert isinstance(w, np.ndarray) and w.shape == (2, 4)
    padded, w = dynamic.pad_to_gear(np.ones((2, 3)), 4, axis=-1)
    assert padded.shape == (2, 4) and w.shape == (2, 4)
    # Rows padded within the batch: their own lengths.
    _, w = dynamic.pad_to_gear(np.ones((3, 4)), 6, lengths=np.array([4, 2, 0]))
    np.testing.assert_array_equal(w.sum(1), [4, 2, 0])
    _, w = dynamic.pad_to_gear(jnp.ones((2, 4)), 4, lengths=jnp.array([1, 4]))
    np.testing.assert_array_equal(w, [[1, 0, 0, 0], [1, 1, 1, 1]])


@pytest.mark.parametrize(
    "batch,size,kwargs,exc,match",
    [
        (np.ones((2, 3)), 2, {}, ValueError, r"the batch has length 3 > size 2"),
        (np.ones((2, 3)), 0, {}, ValueError, r"size must be >= 1"),
        (np.ones((2, 3)), 4.0, {}, TypeError, r"size must be an int"),
        (np.ones((2,)), 4, {}, ValueError, r"no leaf of batch has its sequence axis"),
        ({"a": np.ones((2, 3)), "b": np.ones((2, 5))}, 8, {}, ValueError, r"leaves padded dis"),
        ({"a": np.ones((2, 3))}, 8, {"axis": {"b": 1}}, ValueError, r"axis must be an int or"),
        ({"a": np.ones((2, 3))}, 8, {"axis": {"a": "x"}}, TypeError, r"axis entries must be"),
        (np.ones((2, 3)), 8, {"lengths": np.array([1, 4])}, ValueError, r"lie in \[0, 3\]"),
        (np.ones((2, 3)), 8, {"lengths": np.array([1, 2, 3])}, ValueError, r"does not broad"),
        (np.ones((2, 3)), 8, {"lengths": np.array([1.0, 2.0])}, ValueError, r"must be ints"),
    ],
)
def test_pad_to_gear_bad_input(batch, size, kwargs, exc, match):
    with pytest.raises(exc, match=r"cannjax\.dynamic\.pad_to_gear: .*" + match):
        dynamic.pad_to_gear(batch, size, **kwargs)


# ---------------------------------------------------------------------------------------
# Padded gradients equal the unpadded ones

CFG = cannjax.models.GPTConfig(vocab=32, width=16, heads=2, layers=2, seq_len=16)
LOSSES = {"gpt_loss": cannjax.models.gpt_loss, "plain_gpt_loss": cannjax.models.plain_gpt_loss}


def _rel(a, b):
    a, b = (jnp.concatenate([x.ravel() for x in jax.tree.leaves(t)]) for t in (a, b))
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("name", list(LOSSES))
def test_padded_gradients_equal_unpadded(name):
    loss = LOSSES[name]
    params = cannjax.models.init_gpt(jax.random.key(0), CFG)
    grad = jax.jit(jax.grad(loss), static_argnums=3)
    tokens = rand.randint(jax.random.key(1), (2, 11), 0, CFG.vocab)
    targets = jnp.roll(tokens, -1, axis=1)

    # Every row of length 11, padded to the gear 16 by the geared step.
    step = dynamic.geared(lambda p, b, w: grad(p, b["x"], b["y"], CFG, w), [8, 16])
    padded_grads = step(params, {"x": tokens, "y": targets})
    assert step.sizes == (8, 16) and step.counts == {16: 1}
    assert _rel(padded_grads, grad(params, tokens, targets, CFG, None)) < 1e-5

    if name != "gpt_loss":  # the ragged check compiles two more shapes: once is enough
        return
    # Ragged rows (lengths 11 and 5) in the same padded batch: the token-weighted mean
    # of the rows' own unpadded losses.
    lengths = np.array([11, 5])
    ragged_grads = step(params, {"x": tokens, "y": targets}, lengths=lengths)
    assert step.compiled == 1 and step.real_tokens == 22 + 16

    def ragged(p):
        rows = [
            loss(p, tokens[i : i + 1, :n], targets[i : i + 1, :n], CFG)
            for i, n in enumerate(lengths)
        ]
        return sum(n * r for n, r in zip(lengths, rows)) / lengths.sum()

    assert _rel(ragged_grads, jax.jit(jax.grad(ragged))(params)) < 1e-5


def test_key_mask_makes_non_causal_attention_ignore_padding():
    q, k, v = rand.normal(jax.random.key(0), (3, 1, 5, 2, 8))
    (qp, kp, vp), w = dynamic.pad_to_gear((q, k, v), 8)
    mask = w[:, None, None, :] > 0  # [B, 1, 1, S]: the documented key mask

    def f(q, k, v):
        return jnp.sum(jnp.sin(cannjax.ops.attention(q, k, v)))

    def f_padded(q, k, v):
        out = cannjax.ops.attention(q, k, v, mask=mask)
        return jnp.sum(jnp.sin(out) * w[..., None, None])

    want = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(f_padded, argnums=(0, 1, 2))(qp, kp, vp)
    for g, x in zip(got, want):
        np.testing.assert_allclose(g[:, :5], x, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(g[:, 5:], 0)


# ---------------------------------------------------------------------------------------
# The geared step


def test_geared_compiles_once_per_gear():
    traces = []

    def step(total, batch, weights):
        traces.append(batch.shape)
        return total + jnp.sum(batch * weights), jnp.sum(weights)

    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(np.log(20), 0.6, 100)), 4, 64).astype(int)
    gears = dynamic.plan_gears(lengths, 4)
    run = dynamic.geared(step, gears)
    total = jnp.zeros(())
    for n in lengths:
        total, real = run(total, np.ones((2, int(n)), np.float32))
        assert float(real) == 2 * n
    assert float(total) == 2 * lengths.sum()
    assert run.compiled == len(traces) <= 4 < len(set(lengths.tolist()))
    assert run.steps == 100 and sum(run.counts.values()) == 100
    assert run.real_tokens == 2 * lengths.sum()
    assert run.tokens == 2 * sum(gears.gear_for(int(n)) for n in lengths)
    assert run.overhead == pytest.approx(gears.overhead)  # linear cost: the same ratio
    assert str(run).startswith(f"geared step: 100 steps, {run.compiled} programs compiled")
    assert "<table>" in run._repr_html_()
    # Another batch size is another program, counted.
    run(total, jnp.ones((3, 5)))
    assert run.compiled == len(traces)


def test_geared_overflow():
    def step(batch, weights):
        return jnp.sum(batch * weights)

    strict = dynamic.geared(step, dynamic.plan_gears([4, 8], 2), argnum=0)
    with pytest.raises(ValueError, match=r"cannjax\.dynamic\.geared: a batch of length 9 exceeds"):
        strict(jnp.ones((1, 9)))
    loose = dynamic.geared(
        step, dynamic.plan_gears([4, 8], 2, multiple=4), argnum=0, on_overflow="new_gear"
    )
    with pytest.warns(UserWarning, match="adding a gear of 12"):
        assert float(loose(jnp.ones((1, 9)))) == 9
    assert loose.sizes == (4, 8, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loose(jnp.ones((1, 10)))  # fits the new gear: no warning
    assert loose.compiled == 1


def test_geared_options_and_decorator():
    jitted = jax.jit(lambda s, b, w, scale=1.0: s + scale * jnp.sum(b["x"] * w))
    run = dynamic.geared(jitted, np.array([4, 8]), axis={"x": 1, "n": None})
    assert float(run(0.0, {"x": jnp.ones((2, 3)), "n": jnp.ones(2)}, scale=2.0)) == 12
    assert float(run(0.0, {"x": jnp.ones((2, 3)), "n": jnp.ones(2)}, lengths=np.array([1, 2])))

    @dynamic.geared(gears=[16])
    def step(batch, weights):
        """Doc."""
        return weights

    assert step.__doc__ == "Doc."
    assert dynamic.geared(step.__wrapped__, [16], argnum=0)(jnp.ones((1, 3))).shape == (1, 16)


@pytest.mark.parametrize(
    "step,gears,kwargs,exc,match",
    [
        (3, [4], {}, TypeError, r"step must be callable"),
        (abs, [], {}, ValueError, r"gears is empty"),
        (abs, [4, 0], {}, ValueError, r"gear sizes must be positive ints"),
        (abs, 4, {}, TypeError, r"gears must be a cannjax.dynamic.Gears"),
        (abs, [4], {"on_overflow": "pad"}, ValueError, r"on_overflow must be one of"),
        (abs, [4], {"argnum": -1}, ValueError, r"argnum must be >= 0"),
        (abs, [4], {"argnum": "1"}, TypeError, r"argnum must be an int"),
    ],
)
def test_geared_bad_input(step, gears, kwargs, exc, match):
    with pytest.raises(exc, match=r"cannjax\.dynamic\.geared: .*" + match):
        dynamic.geared(step, gears, **kwargs)


def test_geared_needs_the_batch_argument():
    run = dynamic.geared(lambda s, b, w: s, [4])
    with pytest.raises(TypeError, match=r"geared: the step takes its batch as positional"):
        run(0.0)
