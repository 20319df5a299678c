"""Parameter lists over the registry, shared by the operator tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import cannjax  # noqa: F401  (registers every operator)
from cannjax.core import registry
from cannjax.testing import check_op


def op_configs(family: str | None = None):
    """``pytest.param(name, config)`` for every registered op (of ``family``'s module)."""
    out = []
    for name, spec in sorted(registry().items()):
        if family and not spec.fn.__module__.endswith(family):
            continue
        for cfg in spec.configs:
            label = name + "".join(f"-{k}={v}" for k, v in cfg.items())
            out.append(pytest.param(name, dict(cfg), id=label))
    return out


def cast(args, dtype):
    """Casts the floating-point arguments to ``dtype``."""
    return tuple(
        a.astype(dtype) if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating) else a for a in args
    )


def check_random_points(name, cfg, dtype, seeds=(0,)):
    """check_op at the op's sample points, in ``dtype`` (float64 inside enable_x64)."""
    spec = registry()[name]
    with jax.enable_x64(dtype == "float64"):
        for seed in seeds:
            check_op(name, *cast(spec.sample(jax.random.key(seed)), dtype), seed=seed, **cfg)


def check_edge_points(name, cfg, dtype):
    """check_op at every declared edge point, in ``dtype``."""
    cases = registry()[name].edges()
    assert cases, f"{name} declares no edge points"
    with jax.enable_x64(dtype == "float64"):
        for case in cases:
            check_op(name, *cast(case.args, dtype), **case.check_kwargs(cfg))


def check_half_forward(name, cfg, dtype):
    """The forward in a half dtype returns that dtype and matches the reference."""
    spec = registry()[name]
    args = cast(spec.sample(jax.random.key(0)), dtype)
    assert spec.fn(*args, **cfg).dtype == jnp.dtype(dtype)
    check_op(name, *args, **cfg)


# check_op's random points in make test: float64 (the finite-difference check). float32 in
# make test-extended (CI), where `cannjax ops NAME` (tests/test_cli.py) checks each
# operator's float32 sample under every config as well.
CHECK_DTYPES = [pytest.param("float32", marks=pytest.mark.extended), "float64"]
