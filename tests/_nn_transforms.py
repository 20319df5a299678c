"""Checks that an op composes with JAX's transforms like its plain-JAX reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cannjax.core import registry

TRANSFORMS = ["jit", "grad", "jvp", "jacfwd", "hessian", "vmap", "scan", "checkpoint"]
# hessian in make test-extended (CI): check_op at the random points of make test already
# takes each op's second derivatives.
TRANSFORM_PARAMS = [
    pytest.param(t, marks=pytest.mark.extended) if t == "hessian" else t for t in TRANSFORMS
]


def _close(got, want, rtol=2e-5, atol=2e-6):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def run_transform(name: str, transform: str, args: tuple, **kw) -> None:
    """Applies ``transform`` to the op ``name`` and to its reference; compares them.

    The scalar loss is ``sum(tanh(f(*args)))`` (nonlinear, so second derivatives of a
    linear op are not trivially zero).
    """
    spec = registry()[name]
    n = len(args)
    allargs = tuple(range(n))

    def results(f):
        def loss(*a):
            return jnp.sum(jnp.tanh(f(*a, **kw)))

        if transform == "jit":
            return jax.jit(lambda *a: f(*a, **kw))(*args)
        if transform == "grad":
            return jax.grad(loss, argnums=allargs)(*args)
        if transform == "jvp":
            ts = tuple(jnp.cos(a) for a in args)
            return jax.jvp(lambda *a: f(*a, **kw), args, ts)
        if transform == "jacfwd":
            return jax.jacfwd(lambda *a: f(*a, **kw), argnums=allargs)(*args)
        if transform == "hessian":
            return jax.hessian(loss, argnums=(0, 1))(*args)
        if transform == "vmap":
            xs = jnp.stack([args[0], 0.5 * args[0], -args[0]])
            g = jax.grad(loss, argnums=allargs)
            return jax.vmap(g, in_axes=(0,) + (None,) * (n - 1))(xs, *args[1:])
        if transform == "scan":
            xs = jnp.stack([args[0], 0.5 * args[0], -args[0]])

            def total(*rest):
                body = lambda c, x: (c + loss(x, *rest), None)  # noqa: E731
                return jax.lax.scan(body, jnp.zeros((), args[0].dtype), xs)[0]

            return jax.grad(total, argnums=tuple(range(n - 1)))(*args[1:])
        if transform == "checkpoint":
            return jax.grad(jax.checkpoint(loss), argnums=allargs)(*args)
        raise ValueError(transform)

    _close(results(spec.fn), results(spec.reference))
