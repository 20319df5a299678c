"""logsumexp of complex inputs equals jax.nn.logsumexp's (issue 26, bug 4).

Values, gradients (of real-valued functions of the result, in JAX's convention for
complex inputs), JVPs and second derivatives, for complex ``a``, complex ``b`` and both,
with ``where``, ``keepdims`` and ``return_sign``; the other operators refuse complex
inputs with an error naming them (docs/ops_safe.md lists the difference).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
from tests import _rng as rand

ops = cannjax.ops
_K = jax.random.split(jax.random.key(0), 4)
A = rand.normal(_K[0], (3, 4)) + 1j * rand.normal(_K[1], (3, 4))
B = (rand.normal(_K[2], (3, 4)) + 1j * rand.normal(_K[3], (3, 4))).at[0, 1].set(0)
MASK = jnp.array([[True, True, False, True]] * 3)
CASES = {
    "a": ((A,), {}),
    "a axis": ((A,), {"axis": -1}),
    "a b": ((A,), {"axis": 0, "b": B}),
    "real a, complex b": ((A.real,), {"axis": -1, "b": B}),
    "complex a, real b": ((A,), {"axis": -1, "b": B.real}),
    "where keepdims": ((A,), {"axis": -1, "where": MASK, "keepdims": True}),
    "return_sign": ((A,), {"axis": -1, "b": B, "return_sign": True}),
}


def _weights(o):
    w = jnp.cos(jnp.arange(o.size) + 0.5).reshape(o.shape)
    return w + 0.3j * jnp.sin(w) if jnp.iscomplexobj(o) else w


def _derivatives(f, args, kwargs):
    """Gradient, JVP and a Hessian-vector product of a real function of f's outputs, with
    respect to ``a`` (and ``b`` when given)."""
    kwargs = dict(kwargs)
    b = kwargs.pop("b", None)
    primals = args if b is None else (*args, b)

    def loss(a, *rest):
        out = f(a, **kwargs) if not rest else f(a, b=rest[0], **kwargs)
        return sum(jnp.sum(jnp.real(o * _weights(o))) for o in jax.tree_util.tree_leaves(out))

    @jax.jit  # one compilation instead of one per eager primitive
    def run(primals):
        grad = jax.grad(loss, tuple(range(len(primals))))
        along = tuple(jnp.sin(p) for p in primals)
        return grad(*primals), jax.jvp(loss, primals, along)[1], jax.jvp(grad, primals, along)[1]

    return run(primals)


QUICK = ("real a, complex b", "return_sign")


@pytest.mark.parametrize(
    "case",
    [c if c in QUICK else pytest.param(c, marks=pytest.mark.extended) for c in sorted(CASES)],
)
def test_matches_jax_nn(case):
    args, kwargs = CASES[case]
    got, want = ops.logsumexp(*args, **kwargs), jax.nn.logsumexp(*args, **kwargs)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert (g.dtype, g.shape) == (w.dtype, w.shape)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    got = jax.tree_util.tree_leaves(_derivatives(ops.logsumexp, args, kwargs))
    want = jax.tree_util.tree_leaves(_derivatives(jax.nn.logsumexp, args, kwargs))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.extended
def test_complex128_and_strict_promotion():
    with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
        a = A.astype(jnp.complex128)
        y = ops.logsumexp(a, axis=-1, b=a)
        assert y.dtype == jnp.complex128
        np.testing.assert_allclose(y, jax.nn.logsumexp(a, axis=-1, b=a), rtol=1e-13)
        g = jax.grad(lambda a: jnp.real(ops.logsumexp(a)))(a)
        np.testing.assert_allclose(g, jax.grad(lambda a: jnp.real(jax.nn.logsumexp(a)))(a))


def test_empty_row_keeps_the_real_convention():
    # A row whose every b is 0: log 0 = -inf, gradient 0 (jax.nn: NaN), as for real input.
    a = A[:2]
    b = jnp.ones_like(a).at[1].set(0)
    y = ops.logsumexp(a, axis=-1, b=b)
    assert np.isneginf(y[1].real) and y[1].imag == 0
    g = jax.grad(lambda a: jnp.real(ops.logsumexp(a, axis=-1, b=b)).sum())(a)
    np.testing.assert_array_equal(g[1], 0)
    assert np.isfinite(np.asarray(g)).all()


def test_vmap_and_jit():
    f = jax.jit(jax.vmap(jax.grad(lambda a: jnp.imag(ops.logsumexp(a, b=a)))))
    want = jax.vmap(jax.grad(lambda a: jnp.imag(jax.nn.logsumexp(a, b=a))))(A)
    np.testing.assert_allclose(f(A), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "call",
    [
        lambda z: ops.softmax(z),
        lambda z: ops.gelu(z),
        lambda z: ops.log_softmax(z),
        lambda z: ops.arctan2(z, z),
    ],
    ids=["softmax", "gelu", "log_softmax", "arctan2"],
)
def test_other_operators_refuse_complex_by_name(call):
    with pytest.raises(TypeError, match=r"cannjax\.ops\.\w+: \w+ must be a real .*complex64"):
        call(A)
