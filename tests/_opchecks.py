"""Checks shared by the reduction, loss and safe-op tests: check_op at random and edge
points, transforms against plain JAX, half precision and residual bytes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cannjax.core import registry
from cannjax.inspect import residuals
from cannjax.testing import check_op
from tests._ops import cast


def random_points(name: str, cfg: dict, dtype: str, seeds=(0, 1), **check) -> None:
    """check_op at the spec's random samples."""
    spec = registry()[name]
    with jax.enable_x64(dtype == "float64"):
        for seed in seeds:
            args = cast(spec.sample(jax.random.key(seed)), dtype)
            check_op(name, *args, seed=seed, **check, **cfg)


def edge_points(name: str, dtype: str) -> int:
    """check_op at every declared edge point; returns how many there were."""
    spec = registry()[name]
    cases = spec.edges()
    with jax.enable_x64(dtype == "float64"):
        for case in cases:
            check_op(name, *cast(case.args, dtype), **case.check_kwargs())
    return len(cases)


def first_arg_view(name: str, cfg: dict, key=0):
    """``(ours, plain, x)``: the op and its reference as functions of the first argument
    (the others fixed at the spec's sample), and that argument."""
    spec = registry()[name]
    args = spec.sample(jax.random.key(key))

    def bind(f):
        return lambda x: f(x, *args[1:], **cfg)

    return bind(spec.fn), bind(spec.reference), args[0]


def _scalar(f, out_shape):
    c = jnp.cos(jnp.arange(int(np.prod(out_shape)), dtype=jnp.float32)).reshape(out_shape)
    return lambda x: jnp.sum(f(x) * c)


TRANSFORMS = {
    "jit": lambda f, s: jax.jit(f),
    "grad": lambda f, s: jax.grad(s),
    "jit_grad": lambda f, s: jax.jit(jax.grad(s)),
    "jvp": lambda f, s: lambda x: jax.jvp(f, (x,), (jnp.sin(x + 1),))[1],
    "jacfwd": lambda f, s: jax.jacfwd(f),
    "jacrev": lambda f, s: jax.jacrev(f),
    "hessian": lambda f, s: jax.hessian(s),
    "vmap": lambda f, s: lambda x: jax.vmap(f)(jnp.stack([x, 0.5 * x])),
    "vmap_grad": lambda f, s: lambda x: jax.vmap(jax.grad(s))(jnp.stack([x, 0.5 * x])),
    "checkpoint": lambda f, s: jax.grad(jax.checkpoint(s)),
    "scan": lambda f, s: jax.grad(
        lambda x: jax.lax.scan(lambda acc, w: (acc + s(x * w), None), 0.0, jnp.array([1.0, 0.7]))[0]
    ),
    "scan_jvp": lambda f, s: (
        lambda x: jax.jvp(
            lambda x: jax.lax.scan(
                lambda acc, w: (acc + s(x * w), None), 0.0, jnp.array([1.0, 0.7])
            )[0],
            (x,),
            (jnp.cos(x),),
        )[1]
    ),
}

# The transforms as test parameters. hessian runs in make test-extended (CI): check_op, at
# the random points make test runs, already takes each op's second derivatives (hessian,
# jacfwd of grad, grad of grad).
TRANSFORM_PARAMS = [
    pytest.param(t, marks=pytest.mark.extended) if t == "hessian" else t for t in TRANSFORMS
]


def transform_matches_plain(name: str, cfg: dict, transform: str) -> None:
    """``transform`` of the op equals ``transform`` of its plain-JAX reference."""
    ours, plain, x = first_arg_view(name, cfg)
    shape = jax.eval_shape(ours, x).shape
    t = TRANSFORMS[transform]
    got = t(ours, _scalar(ours, shape))(x)
    want = t(plain, _scalar(plain, shape))(x)
    leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(leaves[0]) == len(leaves[1]), (
        f"{name} {transform}: {len(leaves[0])} arrays vs {len(leaves[1])}"
    )
    for g, w in zip(*leaves, strict=True):
        assert g.shape == w.shape, (g.shape, w.shape)
        assert np.isfinite(np.asarray(g)).all(), f"{name} {transform}: not finite"
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5)


def half_precision_forward(name: str, cfg: dict, dtype: str) -> None:
    """In half precision the op returns the input dtype and the float32 result rounded."""
    spec = registry()[name]
    args32 = spec.sample(jax.random.key(0))
    args = cast(args32, dtype)
    out = spec.fn(*args, **cfg)
    assert out.dtype == jnp.dtype(dtype), out.dtype
    # The float32 reference at the half-precision values themselves.
    want = spec.reference(*cast(args, "float32"), **cfg)
    tol = {"bfloat16": 1e-2, "float16": 2e-3}[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), rtol=tol, atol=tol)
    g = jax.grad(lambda a: jnp.sum(spec.fn(a, *args[1:], **cfg).astype(jnp.float32)))(args[0])
    assert g.dtype == jnp.dtype(dtype) and np.isfinite(np.asarray(g, np.float32)).all()


def residual_bytes(name: str, args: tuple, cfg: dict | None = None, argnums=0):
    """``(ours, plain)`` residual reports of ``sum(op(*args))``, differentiating argnums."""
    spec = registry()[name]
    cfg = cfg or {}
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def loss(f):
        def run(*diff):
            full = list(args)
            for i, d in zip(nums, diff, strict=True):
                full[i] = d
            return jnp.sum(f(*full, **cfg))

        return run

    diff = tuple(args[i] for i in nums)
    return residuals(loss(spec.fn), *diff), residuals(loss(spec.reference), *diff)
