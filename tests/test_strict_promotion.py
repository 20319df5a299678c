"""Every operator under ``jax.numpy_dtype_promotion("strict")`` (issue 26, bug 1).

The "compute in at least float32" rule and every constant an operator mixes with its
inputs must not promote implicitly: strict mode has no path from float64, bfloat16 or
float16 to float32 (nor from bool to float). Each operator runs at its registered sample
in float32, float64, bfloat16 and float16: its value, a gradient and a JVP, and the value
keeps the input dtype. A representative subset runs in ``make test``; the sweep is
extended.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
from cannjax.core import registry
from tests._modes import cast, op_params, value_grad_tangent

ops = cannjax.ops
DTYPES = ["float32", "float64", "bfloat16", "float16"]
# make test: the first config of one op from most families; the sweep is extended.
QUICK = {"softmax", "logsumexp", "relu"}
_FIRST = {p.values[0]: p for p in reversed(op_params(QUICK))}
QUICK_CASES = [_FIRST[name] for name in sorted(QUICK)]
FULL_CASES = [
    pytest.param(*p.values, id=p.id, marks=pytest.mark.extended)
    for p in op_params()
    if p not in QUICK_CASES
]


@contextlib.contextmanager
def _strict(dtype):
    """Strict promotion, with x64 on for float64."""
    with jax.enable_x64(dtype == "float64"), jax.numpy_dtype_promotion("strict"):
        yield


def check_strict(name, cfg, dtype):
    spec = registry()[name]
    with _strict(dtype):
        args = cast(spec.sample(jax.random.key(0)), dtype)
        out, grads, tangent = value_grad_tangent(name, args, cfg)
        for leaf in jax.tree_util.tree_leaves(out):
            assert leaf.dtype == jnp.dtype(dtype), f"{name}: output {leaf.dtype}, input {dtype}"
        for i, g in enumerate(grads):
            assert jnp.isfinite(g.astype(jnp.float32)).all(), f"{name}: gradient {i} not finite"
        for leaf in jax.tree_util.tree_leaves(tangent):
            assert leaf.dtype == jnp.dtype(dtype), f"{name}: tangent {leaf.dtype}, input {dtype}"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name,cfg", QUICK_CASES)
def test_strict_promotion_quick(name, cfg, dtype):
    check_strict(name, cfg, dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name,cfg", [p for p in QUICK_CASES if p.values[0] == "softmax"])
def test_strict_promotion_half_quick(name, cfg, dtype):
    check_strict(name, cfg, dtype)


@pytest.mark.extended
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,cfg", QUICK_CASES + FULL_CASES)
def test_strict_promotion_every_operator(name, cfg, dtype):
    check_strict(name, cfg, dtype)


# ---------------------------------------------------------------- as reported
@pytest.mark.parametrize("dtype", ["float64", "bfloat16", "float16"])
def test_softmax_matches_jax_nn_under_strict(dtype):
    with _strict(dtype):
        x = jnp.linspace(-2.0, 3.0, 7, dtype=dtype)
        got, want = ops.softmax(x), jax.nn.softmax(x)
        assert got.dtype == want.dtype == jnp.dtype(dtype)
        np.testing.assert_allclose(np.float64(got), np.float64(want), rtol=1e-2)


def test_python_scalars_under_x64_and_strict():
    # A Python scalar is weakly typed float64 under x64: logsumexp(1.0) failed there.
    with _strict("float64"):
        assert float(ops.logsumexp(1.0)) == 1.0
        assert float(jax.grad(ops.logsumexp)(1.0)) == 1.0
        np.testing.assert_allclose(jax.grad(ops.gelu)(1.0), jax.grad(jax.nn.gelu)(1.0))


@pytest.mark.parametrize("name", ["exp", "gelu", "relu", "softplus", "log_sigmoid"])
def test_float32_inputs_under_x64_and_strict(name):
    # x64 makes every default-dtype constant float64; the op must still not mix it with
    # a float32 input.
    with _strict("float64"):
        x = jnp.array([-1.5, 0.0, 2.0], jnp.float32)
        y, t = jax.jvp(getattr(ops, name), (x,), (jnp.ones_like(x),))
        g = jax.grad(lambda x: getattr(ops, name)(x).sum())(x)
        assert y.dtype == t.dtype == g.dtype == jnp.float32


@pytest.mark.extended
def test_second_order_and_jacfwd_under_strict():
    with _strict("float64"):
        x, t = jnp.array([0.5, -1.0, 2.0]), jnp.array([1.0, 0.5, -2.0])

        def hvp(f):
            return jax.jvp(jax.grad(f), (x,), (t,))[1]

        np.testing.assert_allclose(hvp(ops.logsumexp), hvp(jax.nn.logsumexp), rtol=1e-12)
        j = jax.jacfwd(ops.softmax)(x)
        np.testing.assert_allclose(j, jax.jacfwd(jax.nn.softmax)(x), rtol=1e-12, atol=1e-14)


def test_relu_gradient_under_strict_selects_the_cotangent():
    # relu keeps a boolean mask: the rule selects the (co)tangent, never bool * float.
    with _strict("float32"):
        x = jnp.array([-1.0, 0.0, 2.0])
        np.testing.assert_array_equal(jax.grad(lambda x: ops.relu(x).sum())(x), [0, 0, 1])


def test_linear_cross_entropy_with_int64_labels_under_strict():
    # Under x64 labels are int64; the one-hot compare must not promote int32 against them.
    with _strict("float64"):
        x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
        w = jnp.linspace(0.5, -0.5, 15).reshape(3, 5)
        labels = jnp.array([0, 4, 2, 1])
        g = jax.grad(lambda x: ops.linear_cross_entropy(x, w, labels, label_smoothing=0.1).sum())(x)
        want = jax.grad(lambda x: _smoothed_ce(x @ w, labels, 0.1).sum())(x)
        np.testing.assert_allclose(g, want, rtol=1e-10)


def _smoothed_ce(logits, labels, eps):
    """Label-smoothed cross-entropy in plain JAX."""
    n = logits.shape[-1]
    target = jax.nn.one_hot(labels, n, dtype=logits.dtype) * (1 - eps) + eps / n
    return -jnp.sum(target * jax.nn.log_softmax(logits), -1)
