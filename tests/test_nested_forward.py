"""A Python float as a primal or tangent in nested forward mode (issue 26, bug 2).

In ``jax.jvp(lambda p, t: jax.jvp(op, (p,), (t,)), (p0, 1.0), ...)`` the inner tangent
is the outer primal ``1.0``, a Python float, which reached the primitives' JVP rules
as it was; they read its ``.dtype``. Every operator that takes scalars is checked against
its plain-JAX reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import cannjax
from cannjax.core import registry

ops = cannjax.ops
# The operators defined on scalars: the elementwise family and the binary safe ops.
SCALAR_OPS = sorted(
    name
    for name, spec in registry().items()
    if spec.fn.__module__.endswith("elementwise") or name in ("arctan2", "xlogy")
)
# The operators it was reported for run in make test; the others are extended.
REPORTED = ["gelu", "log_sigmoid", "sigmoid", "silu", "softplus", "tanh"]
f32 = jnp.float32


def _point(name):
    """Python floats inside the op's domain: the first entry of each sample argument."""
    return tuple(float(a.reshape(-1)[0]) for a in registry()[name].sample(jax.random.key(0)))


def _nested(f, p):
    """d/dp (d/dx f at p along the Python float 1.0) along 1, in nested jvp form."""
    rest = p[1:]

    def inner(x, t):
        return jax.jvp(lambda x: f(x, *rest), (x,), (t,))

    return jax.jvp(inner, (f32(p[0]), 1.0), (f32(1.0), f32(1.0)))


def test_softplus_as_reported():
    (y, dy), (dy2, ddy) = _nested(ops.softplus, (1.0,))
    np.testing.assert_allclose(ddy, 0.9277, rtol=1e-4)
    np.testing.assert_allclose(
        [y, dy, dy2, ddy], jax.tree_util.tree_leaves(_nested(jax.nn.softplus, (1.0,))), rtol=1e-6
    )


@pytest.mark.parametrize(
    "name",
    [n if n in REPORTED else pytest.param(n, marks=pytest.mark.extended) for n in SCALAR_OPS],
)
def test_python_float_tangent_in_nested_jvp(name):
    spec, p = registry()[name], _point(name)
    got = jax.tree_util.tree_leaves(_nested(spec.fn, p))
    want = jax.tree_util.tree_leaves(_nested(spec.reference, p))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize(
    "name",
    [n if n == "softplus" else pytest.param(n, marks=pytest.mark.extended) for n in REPORTED],
)
def test_check_grads_second_order_forward_at_a_python_float(name):
    check_grads(getattr(ops, name), (1e-8,), order=2, modes=["fwd"])
    check_grads(getattr(ops, name), (0.7,), order=2, modes=["fwd", "rev"])
