"""Parameter lists over the registry, shared by the operator tests."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import cannjax  # noqa: F401  (registers every operator)
from cannjax.core import registry


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
