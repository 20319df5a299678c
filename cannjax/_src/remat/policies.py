"""Remat policies over cannjax's named residuals, for :func:`cannjax.remat.checkpoint`.

A policy answers, for each value the forward computes, whether the backward keeps it
(``True``) or recomputes it (``False``); it has ``jax.checkpoint``'s policy signature
``policy(prim, *avals, **params) -> bool``. cannjax operators name their residuals
``cannjax.<op>.<key>`` (for example ``cannjax.exp.out``), so policies can target them.

Example:
  >>> import jax, jax.numpy as jnp, cannjax
  >>> policies = cannjax.remat.policies
  >>> f = lambda x: cannjax.ops.exp(cannjax.ops.sin(x)).sum()
  >>> keep_exp = cannjax.remat.checkpoint(f, policy=policies.save_ops("exp"))
  >>> sorted(str(r.op) for r in cannjax.inspect.residuals(keep_exp, jnp.ones(3)).rows)
  ['None', 'exp']
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any

import jax
from jax._src.ad_checkpoint import name_p

from cannjax._src.core.registry import registry

#: Residual keys that hold statistics (per-row means, inverse deviations, log-sum-exps).
STATISTICS = ("mean", "rstd", "std", "var", "inv_std", "rms", "inv_rms", "lse", "stats", "max")


@dataclasses.dataclass(frozen=True)
class SaveNames:
    """Keeps named residuals whose name matches one of ``patterns`` (``fnmatch``)."""

    patterns: tuple[str, ...]

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> bool:
        if prim is not name_p:
            return False
        return any(fnmatch.fnmatchcase(params["name"], p) for p in self.patterns)


def save_names(*patterns: str) -> SaveNames:
    """Keeps residuals named like any of ``patterns``, e.g. ``"cannjax.layer_norm.*"``."""
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(f"cannjax.remat.policies.save_names: patterns must be str, got {p!r}")
    return SaveNames(tuple(patterns))


def save_ops(*ops: str) -> SaveNames:
    """Keeps every residual of the named cannjax operators (``save_ops("exp", "gelu")``)."""
    for op in ops:
        if not isinstance(op, str) or not op.isidentifier():
            raise TypeError(f"cannjax.remat.policies.save_ops: ops must be names, got {op!r}")
    return SaveNames(tuple(f"cannjax.{op}.*" for op in ops) + tuple(f"cannjax.{op}" for op in ops))


#: Keeps only statistics residuals (normalization means and inverse deviations,
#: log-sum-exps): keys listed in :data:`STATISTICS`; recomputes everything else.
save_statistics = SaveNames(tuple(f"cannjax.*.{k}" for k in STATISTICS))

#: Keeps every cannjax operator's named residuals (what its forward computed for its
#: backward: a gated MLP's pre-activations, a norm's statistics); recomputes the values
#: between operators (an operator's output read by the next one). Around a norm or an
#: activation and the projection that reads it, the pair saves its inputs and no product
#: is computed twice.
save_operator_residuals = SaveNames(("cannjax.*",))

#: Keeps matrix-product outputs (``dot_general``, also inside cannjax operators, whose
#: forwards are traced inline when differentiated); recomputes everything else.
save_dots = jax.checkpoint_policies.dots_saveable

#: Keeps everything (no recomputation); ``jax.checkpoint_policies.everything_saveable``.
everything_saveable = jax.checkpoint_policies.everything_saveable

#: Keeps nothing but the inputs; ``jax.checkpoint_policies.nothing_saveable``.
nothing_saveable = jax.checkpoint_policies.nothing_saveable

_ELEMENTWISE_PRIMS = frozenset(
    "abs add sub mul div neg sign exp exp2 log log1p expm1 tanh logistic sin cos tan "
    "sqrt rsqrt cbrt pow integer_pow max min square erf erfc erf_inv select_n "
    "convert_element_type reduce_precision nextafter atan2 asin acos atan sinh cosh "
    "asinh acosh atanh is_finite eq ne lt le gt ge and or not xor clamp floor ceil round "
    "copy copy_p".split()
)


def _elementwise_op(name: str) -> bool:
    parts = name.split(".")
    if len(parts) < 2 or parts[0] != "cannjax":
        return False
    spec = registry().get(parts[1])
    return spec is not None and spec.fn.__module__.endswith(".elementwise")


@dataclasses.dataclass(frozen=True)
class _AllButElementwise:
    def __call__(self, prim: Any, *avals: Any, **params: Any) -> bool:
        if prim is name_p:
            return not _elementwise_op(params["name"])
        return prim.name not in _ELEMENTWISE_PRIMS


#: Keeps everything except what elementwise operations produce (cannjax elementwise ops,
#: by their registry family, and jax's elementwise primitives): they are recomputed.
save_all_but_elementwise = _AllButElementwise()


@dataclasses.dataclass(frozen=True)
class _AnyOf:
    policies: tuple

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> bool:
        return any(bool(p(prim, *avals, **params)) for p in self.policies)


def any_of(*policies: Any) -> Any:
    """Keeps a value if any of ``policies`` keeps it."""
    for p in policies:
        if not callable(p):
            raise TypeError(f"cannjax.remat.policies.any_of: policies must be callable, got {p!r}")
    return _AnyOf(tuple(policies))
