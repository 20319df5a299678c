"""The operator model: hand-written rules run, and compose with every JAX transform."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import cannjax
from cannjax.core import EdgeCase, Level, OpSpec, defop, lookup, register, registry
from tests import _rng as rand

# ---------------------------------------------------------------- test operators
# A scaled product a * b whose backward is deliberately scaled by `k` (k = 1 is right):
# reverse mode must return k times the true gradient, forward mode the true tangent.
CALLS = {"forward": 0, "backward": 0, "tangent": 0}


def _mul_forward(a, b, *, k):
    CALLS["forward"] += 1
    return a * b, {"a": a, "b": b}


def _mul_tangent(res, ta, tb, *, k):
    CALLS["tangent"] += 1
    return ta * res["b"] + res["a"] * tb


def _mul_backward(res, g, *, k):
    CALLS["backward"] += 1
    return (k * g * res["b"], k * g * res["a"])


mul = defop("test_mul", forward=_mul_forward, tangent=_mul_tangent, backward=_mul_backward)


def f_ours(x):
    return jnp.sum(jnp.sin(cannjax.ops.exp(x)) * mul(x, x, k=1.0))


def f_plain(x):
    return jnp.sum(jnp.sin(jnp.exp(x)) * x * x)


X = jnp.array([0.1, 0.5, -1.0, 2.0])


def close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


# ---------------------------------------------------------------- the backward is ours
def test_reverse_mode_runs_the_hand_written_backward():
    x, y = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
    ga, gb = jax.grad(lambda a, b: mul(a, b, k=3.0).sum(), argnums=(0, 1))(x, y)
    close(ga, 3 * y)  # the scaled backward ran, not a transpose derived from forward
    close(gb, 3 * x)
    _, t = jax.jvp(lambda a: mul(a, y, k=3.0), (x,), (jnp.ones(2),))
    close(t, y)  # forward mode runs the tangent rule


def test_grad_program_is_forward_plus_hand_written_backward():
    before = dict(CALLS)
    jaxpr = jax.make_jaxpr(jax.grad(lambda a: mul(a, a, k=1.0).sum()))(X)
    assert CALLS["backward"] == before["backward"] + 1
    # The tangent rule is traced for shapes only; the linear primitive never reaches the
    # program: reverse mode replaced it with the backward.
    assert "cannjax_lin" not in str(jaxpr)


# ---------------------------------------------------------------- transforms
TRANSFORMS = {
    "grad": lambda f: jax.grad(f),
    "jit_grad": lambda f: jax.jit(jax.grad(f)),
    "value_and_grad": lambda f: lambda x: jax.value_and_grad(f)(x)[1],
    "jvp": lambda f: lambda x: jax.jvp(f, (x,), (jnp.cos(x),))[1],
    "linearize": lambda f: lambda x: jax.linearize(f, x)[1](jnp.cos(x)),
    "jacfwd": lambda f: jax.jacfwd(f),
    "jacrev": lambda f: jax.jacrev(f),
    "hessian": lambda f: jax.hessian(f),
    "jacfwd_jacfwd": lambda f: jax.jacfwd(jax.jacfwd(f)),
    "jacrev_jacfwd": lambda f: jax.jacrev(jax.jacfwd(f)),
    "grad_grad": lambda f: jax.grad(lambda x: jax.grad(f)(x).sum()),
    "checkpoint": lambda f: jax.grad(jax.checkpoint(f)),
    "vmap_grad": lambda f: lambda x: jax.vmap(jax.grad(f))(jnp.stack([x, 2 * x])),
    "grad_vmap": lambda f: jax.grad(lambda x: jax.vmap(f)(jnp.stack([x, 2 * x])).sum()),
    "vmap_axis1": lambda f: lambda x: jax.vmap(jax.grad(f), in_axes=1)(jnp.stack([x, x]).T),
    "jit_vmap_hessian": lambda f: lambda x: jax.jit(jax.vmap(jax.hessian(f)))(jnp.stack([x, -x])),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_transform_matches_plain_jax(name):
    t = TRANSFORMS[name]
    close(t(f_ours)(X), t(f_plain)(X), rtol=2e-5, atol=1e-5)


def test_scan_grad_and_jvp():
    ws = jnp.full((3, 4), 0.3)

    def run(exp):
        return lambda x: jax.lax.scan(lambda c, w: (exp(c * w), None), x, ws)[0].sum()

    ours, plain = run(cannjax.ops.exp), run(jnp.exp)
    close(jax.grad(ours)(X), jax.grad(plain)(X))
    close(jax.jvp(ours, (X,), (X,))[1], jax.jvp(plain, (X,), (X,))[1])


def test_vmap_with_unbatched_differentiable_argument():
    xs = jnp.stack([X, 2 * X])
    g = jax.grad(lambda w: jax.vmap(lambda a: mul(a, w, k=1.0))(xs).sum())(X)
    close(g, xs.sum(0))


def test_shard_map_value_and_grad():
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    x = jnp.arange(8.0) / 8

    def loss(x):
        return jax.lax.psum(cannjax.ops.exp(x).sum(), "d")

    sm = jax.shard_map(loss, mesh=mesh, in_specs=P("d"), out_specs=P())
    close(jax.jit(sm)(x), jnp.exp(x).sum())
    close(jax.jit(jax.grad(sm))(x), jnp.exp(x))
    close(jax.jvp(sm, (x,), (x,))[1], (jnp.exp(x) * x).sum())


def test_checkpoint_policy_targets_named_residuals():
    policy = jax.checkpoint_policies.save_only_these_names("cannjax.exp.out")
    f = jax.checkpoint(lambda x: jnp.sum(cannjax.ops.sin(cannjax.ops.exp(x))), policy=policy)
    report = cannjax.inspect.residuals(f, X)
    names = {r.op for r in report.rows}
    assert "exp" in names and "sin" not in names
    close(jax.grad(f)(X), jnp.cos(jnp.exp(X)) * jnp.exp(X))


def test_eager_and_python_scalars():
    assert float(cannjax.ops.exp(0.0)) == 1.0
    assert float(jax.grad(cannjax.ops.tanh)(0.0)) == 1.0


def test_retracing_is_bounded():
    f = jax.jit(jax.grad(lambda x: cannjax.ops.gelu(x).sum()))
    f(X)
    f(X + 1)
    assert f._cache_size() == 1


# ---------------------------------------------------------------- registry
# Names in cannjax.ops that are not operators: helpers and a result type.
_NOT_OPERATORS = ("registry", "attention_block_sizes", "rope_frequencies", "PreferenceMetrics")


def test_registry_is_read_only_and_complete():
    reg = registry()
    with pytest.raises(TypeError):
        reg["x"] = None
    for name in cannjax.ops.__all__:
        if name in _NOT_OPERATORS:
            continue
        spec = lookup(getattr(cannjax.ops, name))
        assert spec.name in reg
        assert callable(spec.fn) and callable(spec.reference) and callable(spec.sample)
        assert isinstance(spec.level, Level) and spec.residuals


def test_user_defined_op_can_be_registered_and_checked():
    spec = OpSpec(
        name="test_cube",
        fn=lambda x: _cube(x),
        reference=lambda x: x**3,
        sample=lambda key: (rand.normal(key, (4,)),),
        residuals={"x": "the input"},
        edges=lambda: [EdgeCase((jnp.zeros(3),))],
    )
    register(spec, overwrite=True)
    assert lookup("test_cube") is spec
    cannjax.testing.check_op("test_cube", jnp.array([0.5, -2.0]))
    with pytest.raises(ValueError, match="already registered"):
        register(spec)


def test_opspec_doc_defaults_to_the_first_docstring_line():
    def fn(x):
        """Cubes x.

        More text.
        """

    common = dict(reference=fn, sample=lambda key: (), residuals={})
    assert OpSpec(name="a", fn=fn, **common).doc == "Cubes x."
    assert OpSpec(name="a", fn=fn, doc="Own summary.", **common).doc == "Own summary."
    assert OpSpec(name="a", fn=lambda x: x, **common).doc == ""
    for name in cannjax.ops.__all__:
        if name in _NOT_OPERATORS:
            continue
        spec = lookup(getattr(cannjax.ops, name))
        assert spec.doc, f"{spec.name} has no doc"


_cube = defop(
    "test_cube",
    forward=lambda x: (x**3, {"x": x}),
    tangent=lambda res, t: 3 * res["x"] ** 2 * t,
    backward=lambda res, g: (3 * res["x"] ** 2 * g,),
)


def test_defop_rejects_bad_declarations():
    with pytest.raises(TypeError, match="forward must be callable"):
        defop("bad", forward=None, tangent=lambda r, t: t, backward=lambda r, g: (g,))
    with pytest.raises(ValueError, match="name must be an identifier"):
        defop("no good", forward=abs, tangent=abs, backward=abs)
    with pytest.raises(TypeError, match="keyword arguments must be hashable"):
        mul(X, X, k=[1.0])
    with pytest.raises(KeyError, match="no operator named"):
        lookup("does_not_exist")
    with pytest.raises(TypeError, match="must be an OpSpec"):
        register("exp")
    with pytest.raises(
        TypeError, match=r"cannjax.defop: expected forward=.*got \['backward', 'forwrd'"
    ):
        defop("typo", forwrd=abs, tangent=abs, backward=abs)
    with pytest.raises(TypeError, match="registered: op must be an Operator"):
        cannjax.core.registered("exp", reference=abs)


def test_registered_puts_the_rule_metadata_and_the_function_in_one_spec():
    op = defop(
        "test_registered_cube",
        forward=lambda x: (x**3, {"x": x}),
        tangent=lambda res, t: 3 * res["x"] ** 2 * t,
        backward=lambda res, g: (3 * res["x"] ** 2 * g,),
        residuals={"x": "the input x"},
        level=Level.RECOMPUTE,
    )

    @cannjax.core.registered(op, reference=lambda x: x**3, sample=lambda key: (X,))
    def cube(x):
        "x cubed."
        return op(x)

    spec = lookup(cube)
    assert (spec.name, spec.fn, dict(spec.residuals), spec.level, spec.reuse, spec.doc) == (
        "test_registered_cube",
        cube,
        {"x": "the input x"},
        Level.RECOMPUTE,
        (),
        "x cubed.",
    )
    cannjax.testing.check_op(cube, X)


def test_backward_must_return_a_tuple():
    bad = defop(
        "test_bad_backward",
        forward=lambda x: (2 * x, {}),
        tangent=lambda res, t: 2 * t,
        backward=lambda res, g: 2 * g,
    )
    with pytest.raises(TypeError, match="backward must return a tuple"):
        jax.grad(lambda x: bad(x).sum())(X)


def test_multiple_outputs_and_nondiff_arguments():
    # (x * m, x + 1) with a boolean m that gets no gradient.
    op = defop(
        "test_two",
        forward=lambda x, m: ((jnp.where(m, x, 0.0), x + 1), {"m": m}),
        tangent=lambda res, t: (jnp.where(res["m"], t, 0.0), t),
        backward=lambda res, g: (jnp.where(res["m"], g[0], 0.0) + g[1],),
        nondiff_argnums=(1,),
        num_outputs=2,
    )
    m = jnp.array([True, False, True, False])
    g = jax.grad(lambda x: sum(o.sum() for o in op(x, m)))(X)
    close(g, jnp.where(m, 2.0, 1.0))
    close(jax.vmap(lambda x: op(x, m)[0])(jnp.stack([X, X])), jnp.stack([X * m] * 2))
    close(jax.jacfwd(lambda x: op(x, m)[0])(X), jnp.diag(m.astype(X.dtype)))


def test_edge_case_kwargs_win_over_the_config_they_run_under():
    case = EdgeCase((X,), kwargs={"axis": -1})
    merged = case.check_kwargs({"axis": 0, "eps": 1.0})
    assert (merged["axis"], merged["eps"]) == (-1, 1.0)
    assert case.check_kwargs()["axis"] == -1
    (written,) = cannjax.core.written_for({"axis": -1, "k": 2}, lambda: [EdgeCase((X,))])()
    assert written.kwargs == {"axis": -1, "k": 2}
    (named,) = cannjax.core.written_for({"axis": -1}, lambda: [EdgeCase((X,), {"axis": 0})])()
    assert named.kwargs == {"axis": 0}
