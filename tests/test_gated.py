"""swiglu and geglu: check_op, plain-JAX equality, transforms, residuals, backward dot
forms, half precision and bad input."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
from cannjax.core import registry
from cannjax.inspect import residuals
from cannjax.testing import check_op
from tests import _rng as rand
from tests._ops import cast, check_half_forward, check_random_points, op_configs

OPS = op_configs("gated")
NAMES = ["geglu", "swiglu"]
EXTENDED = pytest.mark.extended


def _plain(name, cfg):
    """The same MLP written with jax.nn and ``@``, as a user would."""
    act = jax.nn.silu if name == "swiglu" else lambda a: jax.nn.gelu(a, **cfg)
    return lambda x, wg, wu, wd: (act(x @ wg) * (x @ wu)) @ wd


def _op(name, cfg):
    fn = registry()[name].fn
    return lambda *a: fn(*a, **cfg)


def test_family_is_registered():
    assert sorted({p.values[0] for p in OPS}) == NAMES
    assert registry()["swiglu"].fn is cannjax.ops.swiglu
    assert registry()["geglu"].fn is cannjax.ops.geglu


# ---------------------------------------------------------------- check_op
# make test: each op's first config; its other configs in make test-extended (CI).
_FIRST = {p.values[0]: p.id for p in reversed(OPS)}


@pytest.mark.parametrize(
    "name,cfg",
    [pytest.param(*p.values, id=p.id, marks=() if _FIRST[p.values[0]] == p.id else EXTENDED)
     for p in OPS],
)  # fmt: skip
@pytest.mark.parametrize("dtype", ["float32", pytest.param("float64", marks=EXTENDED)])
def test_check_op_random_points(name, cfg, dtype):
    check_random_points(name, cfg, dtype, seeds=(1,))


def test_check_op_random_point_float64_swiglu():
    check_random_points("swiglu", {}, "float64", seeds=(2,))


@pytest.mark.parametrize("name,cfg", OPS)
# float32 edge points: `cannjax ops` runs check_op at each of them, under every config
# (tests/test_cli.py, extended for these ops as for these float64 points).
@pytest.mark.parametrize("dtype", ["float64"])
@EXTENDED
def test_check_op_edge_points(name, cfg, dtype):
    cases = registry()[name].edges()
    with jax.enable_x64(dtype == "float64"):
        for case in cases:
            check_op(name, *cast(case.args, dtype), **case.check_kwargs(cfg))


@pytest.mark.parametrize("name,cfg", [("swiglu", {}), ("geglu", {"approximate": True})])
def test_check_op_at_saturated_pre_activations(name, cfg):
    # The fast subset of the edge points: |a| from 2e18 to 7e19, where plain autodiff of gelu's
    # tanh form gives NaN (a**2 overflows, times a zero tanh') and the rules must stay
    # finite, second order included.
    (case,) = [c for c in registry()[name].edges() if not c.reference_grad]
    assert float(jnp.abs(case.args[0] @ case.args[1]).min()) > 1e18
    check_op(name, *case.args, **case.check_kwargs(cfg))
    x, wg, wu, wd = case.args
    plain = jax.grad(lambda wg: jnp.sum(_plain(name, cfg)(x, wg, wu, wd)))(wg)
    ours = jax.grad(lambda wg: jnp.sum(_op(name, cfg)(x, wg, wu, wd)))(wg)
    assert np.isfinite(ours).all()
    if name == "geglu":
        assert np.isnan(plain).any()  # the point is one that plain autodiff gets wrong


@pytest.mark.parametrize("name,cfg", OPS)
def test_bfloat16_values(name, cfg):
    check_half_forward(name, cfg, "bfloat16")


# ---------------------------------------------------------------- against plain JAX
@pytest.mark.parametrize("name,cfg", OPS)
def test_values_and_gradients_equal_plain_autodiff(name, cfg):
    k = jax.random.split(jax.random.key(0), 5)
    x = 2 * rand.normal(k[0], (3, 5, 16))
    wg, wu = (rand.normal(kk, (16, 24)) / 4 for kk in k[1:3])
    wd = rand.normal(k[3], (24, 8)) / 5
    c = rand.normal(k[4], (3, 5, 8))
    args = (x, wg, wu, wd)
    ours, plain = _op(name, cfg), _plain(name, cfg)
    np.testing.assert_allclose(ours(*args), plain(*args), rtol=2e-5, atol=2e-5)
    grad = lambda f: jax.grad(lambda *a: jnp.sum(f(*a) * c), argnums=(0, 1, 2, 3))  # noqa: E731
    for g, w in zip(grad(ours)(*args), grad(plain)(*args), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_transforms_match_plain():
    # Beyond check_op's jvp, vjp, vmap, jit and second order: vmap of grad, grad through
    # lax.scan and through jax.checkpoint.
    spec = registry()["swiglu"]
    x, wg, wu, wd = spec.sample(jax.random.key(3))
    plain = _plain("swiglu", {})

    def results(f):
        loss = lambda x, wg: jnp.sum(jnp.tanh(f(x, wg, wu, wd)))  # noqa: E731
        xs = jnp.stack([x, 0.5 * x])
        scanned = lambda wg: jax.lax.scan(  # noqa: E731
            lambda c, x: (c + loss(x, wg), None), jnp.zeros(()), xs
        )[0]
        return {
            "vmap_grad": jax.vmap(jax.grad(loss, argnums=(0, 1)), (0, None))(xs, wg),
            "scan": jax.grad(scanned)(wg),
            "checkpoint": jax.grad(jax.checkpoint(loss), argnums=(0, 1))(x, wg),
        }

    got, want = results(spec.fn), results(plain)
    for key in want:
        for g, w in zip(jax.tree.leaves(got[key]), jax.tree.leaves(want[key]), strict=True):
            np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5, err_msg=key)


# ---------------------------------------------------------------- residuals
def _gradient_residuals(f, shapes, dtype=jnp.float32):
    specs = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    return residuals(lambda *a: jnp.sum(f(*a)), *specs)


def test_swiglu_mlp_residual_bytes_against_plain_autodiff():
    # The target: D=1024, F=2816, N=4096, float32, grad w.r.t. every argument.
    # Residuals are traced abstractly (nothing runs): 137.0 MiB against 313.0 MiB (0.44x).
    D, F, N = 1024, 2816, 4096
    shapes = [(N, D), (D, F), (D, F), (F, D)]
    ours = _gradient_residuals(cannjax.ops.swiglu, shapes)
    plain = _gradient_residuals(_plain("swiglu", {}), shapes)
    assert ours.total_bytes <= 0.6 * plain.total_bytes, f"ours:\n{ours}\nplain:\n{plain}"
    # Inputs (x and the three weights) plus the two [N, F] pre-activations, nothing else.
    assert ours.total_bytes == 4 * (N * D + 3 * D * F + 2 * N * F), str(ours)


def test_scanned_stack_gradient_memory_against_plain():
    # Under lax.scan over stacked weights every residual is stacked across layers, so
    # the residual saving shows in compiled memory: 4 x [256, 64 -> 176] measured
    # 2.5 vs 5.0 MiB of temp (8 x [4096, 1024 -> 2816]: 1062 vs 2398 MiB).
    L, N, D, F = 4, 256, 64, 176
    specs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in
             [(N, D), (L, D, F), (L, D, F), (L, F, D)]]  # fmt: skip

    def temp(mlp):
        def loss(x, *ws):
            h = jax.lax.scan(lambda h, w: (h + mlp(h, *w), None), x, ws)[0]
            return jnp.sum(h * h)

        grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
        return jax.jit(grad).lower(*specs).compile().memory_analysis().temp_size_in_bytes

    ours, plain = temp(cannjax.ops.swiglu), temp(_plain("swiglu", {}))
    assert ours <= 0.6 * plain, (ours, plain)


@pytest.mark.parametrize("name,cfg", OPS)
def test_keeps_inputs_and_the_two_pre_activations_only(name, cfg):
    shapes = [(2, 3, 8), (8, 12), (8, 12), (12, 6)]
    report = _gradient_residuals(_op(name, cfg), shapes)
    named = sorted(
        re.search(rf"cannjax\.{name}\.(\w+)", r.source).group(1)
        for r in report.rows
        if r.op == name
    )
    assert named == ["a", "b"], str(report)
    assert sorted(r.shape for r in report.rows) == sorted([*shapes, (2, 3, 12), (2, 3, 12)]), str(
        report
    )
    # The input residuals are the arguments themselves, not copies.
    assert sum("argument" in r.source for r in report.rows) == 4, str(report)


def test_half_precision_keeps_half_precision_residuals():
    report = _gradient_residuals(
        cannjax.ops.swiglu, [(4, 8), (8, 12), (8, 12), (12, 6)], "bfloat16"
    )
    assert {r.dtype for r in report.rows} == {"bfloat16"}, str(report)


# ---------------------------------------------------------------- backward dot forms
_DOT = re.compile(r" dot\((.*)")


def _dots(f, args):
    grad = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2, 3))
    text = jax.jit(grad).lower(*args).compile().as_text()
    return [m.group(1) for m in map(_DOT.search, text.splitlines()) if m]


def test_backward_dots_stay_canonical_for_rank3_input():
    # Rows folded, as cannjax.ops.linear's backward does: the forward products and the
    # input cotangents contract the left operand's last axis, each weight gradient is
    # one dot contracting the rows of both operands.
    args = (jnp.ones((2, 8, 16)), jnp.ones((16, 32)), jnp.ones((16, 32)), jnp.ones((32, 16)))
    dots = _dots(cannjax.ops.swiglu, args)
    # 3 forward products; dh = g w_down^T, dw_down, 2 for dx, dw_gate, dw_up: a and b
    # are kept, not recomputed.
    assert len(dots) == 9, dots
    rows = "lhs_contracting_dims={0}, rhs_contracting_dims={0}"
    assert sum(rows in d for d in dots) == 3, dots
    assert sum("lhs_contracting_dims={1}" in d for d in dots) == 6, dots
    assert all("batch_dims" not in d for d in dots), dots


# ---------------------------------------------------------------- half precision
@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_gradients_are_close_to_float32(name):
    spec = registry()[name]
    args = spec.sample(jax.random.key(4))
    c = rand.normal(jax.random.key(5), (2, 3, 6))

    def grads(dtype):
        a = cast(args, dtype)
        f = lambda *a: jnp.sum(spec.fn(*a).astype(jnp.float32) * c)  # noqa: E731
        return jax.grad(f, argnums=(0, 1, 2, 3))(*a)

    for g, w in zip(grads("bfloat16"), grads("float32"), strict=True):
        assert g.dtype == jnp.bfloat16
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=0, atol=3e-2 * scale)


def test_mixed_dtypes_promote():
    x, w, wd = jnp.ones((2, 4), jnp.bfloat16), jnp.ones((4, 3)), jnp.ones((3, 2))
    assert cannjax.ops.swiglu(x, w, w, wd).dtype == jnp.float32
    half = [a.astype(jnp.bfloat16) for a in (w, w, wd)]
    assert cannjax.ops.swiglu(x, *half).dtype == jnp.bfloat16


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("name", NAMES)
def test_rejects_wrong_shapes(name):
    fn = registry()[name].fn
    x, wg, wd = jnp.ones((2, 4)), jnp.ones((4, 3)), jnp.ones((3, 5))
    fn(x, wg, wg, wd)  # the valid call
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"cannjax.ops.{name}: w_gate must have shape (D, F) with D == x.shape[-1] == 4, "
            "got (5, 3)"
        ),
    ):
        fn(x, jnp.ones((5, 3)), wg, wd)
    with pytest.raises(ValueError, match=rf"cannjax\.ops\.{name}: w_gate must have shape"):
        fn(x, jnp.ones(4), wg, wd)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"cannjax.ops.{name}: w_up must have the shape of w_gate, (D, F) == (4, 3), got (4, 2)"
        ),  # fmt: skip
    ):
        fn(x, wg, jnp.ones((4, 2)), wd)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"cannjax.ops.{name}: w_down must have shape (F, E) with F == w_gate.shape[1] == "
            "3, got (4, 5)"
        ),
    ):
        fn(x, wg, wg, jnp.ones((4, 5)))
    with pytest.raises(ValueError, match=rf"cannjax\.ops\.{name}: w_down must have shape"):
        fn(x, wg, wg, jnp.ones((3, 5, 1)))
    with pytest.raises(ValueError, match=rf"cannjax\.ops\.{name}: x must have rank >= 1"):
        fn(jnp.float32(1.0), wg, wg, wd)


@pytest.mark.parametrize("name", NAMES)
def test_rejects_non_float_input(name):
    fn = registry()[name].fn
    x, wg, wd = jnp.ones((2, 4)), jnp.ones((4, 3)), jnp.ones((3, 5))
    with pytest.raises(TypeError, match=rf"cannjax\.ops\.{name}: x must be a floating-point"):
        fn(jnp.ones((2, 4), jnp.int32), wg, wg, wd)
    with pytest.raises(TypeError, match=rf"cannjax\.ops\.{name}: w_up must be a floating-point"):
        jax.jit(fn)(x, wg, jnp.ones((4, 3), bool), wd)
    with pytest.raises(TypeError, match=rf"cannjax\.ops\.{name}: w_down must be a floating-point"):
        fn(x, wg, wg, jnp.ones((3, 5), jnp.int8))


def test_geglu_rejects_non_bool_approximate():
    x, w = jnp.ones((2, 4)), jnp.ones((4, 3))
    with pytest.raises(TypeError, match=r"cannjax\.ops\.geglu: approximate must be True"):
        cannjax.ops.geglu(x, w, w, jnp.ones((3, 2)), approximate="tanh")
