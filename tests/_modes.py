"""Running a registered operator's value, gradient and tangent at one point, for the
tests of JAX's modes (strict dtype promotion, debug_nans and debug_infs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax  # noqa: F401  (registers every operator)
from cannjax.core import registry


def op_params(names=None, marks=()):
    """``pytest.param(name, config)`` for every config of the ops in ``names`` (all when
    None), with ``marks``."""
    out = []
    for name, spec in sorted(registry().items()):
        if names is not None and name not in names:
            continue
        for cfg in spec.configs:
            label = name + "".join(f"-{k}={v}" for k, v in cfg.items())
            out.append(pytest.param(name, dict(cfg), id=label, marks=marks))
    return out


def _is_float(a) -> bool:
    return jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating)


def cast(args, dtype):
    """The floating arguments of ``args`` as ``dtype``, the others unchanged."""
    return tuple(jnp.asarray(a, dtype) if _is_float(a) else a for a in args)


def diff_argnums(name: str, args) -> tuple[int, ...]:
    """The arguments the op differentiates: floating and not in ``nondiff_argnums``."""
    spec = registry()[name]
    return tuple(i for i, a in enumerate(args) if i not in spec.nondiff_argnums and _is_float(a))


def of_diff_args(name: str, args, kwargs):
    """``(f, primals)``: ``f(*primals)`` is the op's output as a function of its
    differentiable arguments, the others fixed at ``args``."""
    spec, nums = registry()[name], diff_argnums(name, args)

    def f(*diff):
        full = list(args)
        for i, d in zip(nums, diff, strict=True):
            full[i] = d
        return spec.fn(*full, **kwargs)

    return f, tuple(args[i] for i in nums)


def scalar_loss(name: str, args, kwargs):
    """``(loss, primals)``: ``loss(*primals)`` is the sum of the finite entries of the op's
    outputs (in float32, as a user would log it; ``inf - inf`` would make the sum NaN) as
    a function of its differentiable arguments."""
    f, primals = of_diff_args(name, args, kwargs)

    def loss(*diff):
        leaves = [leaf.astype(jnp.float32) for leaf in jax.tree_util.tree_leaves(f(*diff))]
        return sum(jnp.sum(jnp.where(jnp.isfinite(x), x, 0.0)) for x in leaves)

    return loss, primals


def value_grad_tangent(name: str, args, kwargs):
    """The op's output, the gradient of :func:`scalar_loss` and the op's JVP along ones
    (None, None without a differentiable argument)."""
    out = registry()[name].fn(*args, **kwargs)
    loss, primals = scalar_loss(name, args, kwargs)
    if not primals:
        return out, None, None
    grads = jax.grad(loss, tuple(range(len(primals))))(*primals)
    f, _ = of_diff_args(name, args, kwargs)
    return out, grads, jax.jvp(f, primals, ones(primals))[1]


def ones(primals):
    """A finite tangent for each primal."""
    return tuple(jnp.ones_like(p) for p in primals)


def all_finite(tree) -> bool:
    """Whether every inexact leaf of ``tree`` is finite."""
    return all(
        np.isfinite(np.asarray(leaf, np.complex128)).all()
        for leaf in jax.tree_util.tree_leaves(tree)
        if jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.inexact)
    )
