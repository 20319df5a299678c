"""Layer loops: each carry placed as its initial value is under a sharded program, and
half-precision loops unrolled where the platform writes stacked half arrays through float32.

A scanned model (``lax.scan``, ``nnx.scan``, equinox layers under ``lax.scan``) carries
its activations ``[B, T, D]`` through the layer loop. Where the program shards the
parameters (FSDP: the width ``D`` over the data axis), the partitioner may place the
carry as the loop body's weights are, over ``D``, rather than as the activations entering
the loop are, over the batch: each device then runs every sequence's attention, and the
carry is gathered and scattered at every layer (flax.nnx's scanned GPT under FSDP 8x1:
``docs/parallel.md``). ``optimize`` groups each floating carry of a top-level ``scan``
with its initial value (:func:`cannjax._src.core.partitioned.placed_like`): the
partitioner gives them one placement, which it chooses. On one device it is the identity.

A top-level scan that computes in half precision saves its residuals stacked ``[L, ...]``
in half precision. XLA:CPU has no half-precision ``dynamic-update-slice``: it writes each
layer's slice by converting the whole stack to float32 and back, ``O(L^2)`` conversions
per step, and carries some stacks in float32 between the loops
(``PlatformFacts.half_stacks_convert``). There ``optimize`` runs such a scan unrolled
(``unroll=length``: each layer's residuals are separate arrays), as the models do
(``GPTConfig.unroll``); the program computes the same values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax._src import core as jcore

from cannjax._src.core import jaxpr as J
from cannjax._src.core import rewrite as R
from cannjax._src.core.partitioned import placed_like
from cannjax._src.core.platform import facts


def _placeable(aval) -> bool:
    return getattr(aval, "ndim", 0) >= 1 and jnp.issubdtype(aval.dtype, jnp.floating)


def _scan_placed(eqn: jcore.JaxprEqn):
    """The scan ``eqn``, its float carries placed as their initial values."""
    lo = eqn.params["num_consts"]
    n = eqn.params["num_carry"]

    def run(*invals):
        outs = J.bind_eqn(eqn, invals)
        for i in range(n):
            if _placeable(eqn.outvars[i].aval):
                outs[i] = placed_like(outs[i], invals[lo + i])
        return outs if len(outs) > 1 else outs[0]  # as R.Call reads its result

    return run


def _top_level_rewritten(
    jaxpr: jcore.Jaxpr, consts: tuple, step_of: Callable[[jcore.JaxprEqn], Any]
) -> tuple[jcore.Jaxpr, tuple, int]:
    """``jaxpr`` with each top-level equation for which ``step_of`` gives a rewrite step
    (an ``R.Call`` or ``R.Bind``; None: left as it is) rewritten; returns it, its
    constants and how many equations changed."""
    steps: list[Any] = []
    count = 0
    for eqn in jaxpr.eqns:
        step = step_of(eqn)
        count += step is not None
        steps.append(R.Bind(eqn) if step is None else step)
    if not count:
        return jaxpr, consts, 0
    new, new_consts = R.retrace(jaxpr, steps)
    return new, (*new_consts, *consts), count


def carries_placed_like_init(jaxpr: jcore.Jaxpr, consts: tuple) -> tuple[jcore.Jaxpr, tuple, int]:
    """``jaxpr`` with the carries of its top-level scans placed as their initial values;
    returns it, its constants and how many scans it changed."""

    def step_of(eqn):
        n = eqn.params.get("num_carry", 0) if eqn.primitive.name == "scan" else 0
        if not any(_placeable(v.aval) for v in eqn.outvars[:n]):
            return None
        return R.Call(_scan_placed(eqn), tuple(eqn.invars), tuple(eqn.outvars), eqn)

    return _top_level_rewritten(jaxpr, consts, step_of)


def _computes_in_half(body: jcore.Jaxpr) -> bool:
    avals = [v.aval for v in body.invars] + [v.aval for e in body.eqns for v in e.outvars]
    return any(
        jnp.issubdtype(getattr(a, "dtype", jnp.int32), jnp.floating) and a.dtype.itemsize == 2
        for a in avals
    )


def half_loops_unrolled(jaxpr: jcore.Jaxpr, consts: tuple) -> tuple[jcore.Jaxpr, tuple, int]:
    """``jaxpr`` with its top-level scans that compute in half precision unrolled, where
    the default backend writes stacked half arrays through float32; returns it, its
    constants and how many scans it unrolled."""
    if not facts().half_stacks_convert:
        return jaxpr, consts, 0

    def step_of(eqn):
        p = eqn.params
        if (
            eqn.primitive.name != "scan"
            or p["length"] <= 1
            or p["unroll"] == p["length"]
            or not _computes_in_half(p["jaxpr"].jaxpr)
        ):
            return None
        return R.Bind(eqn, params={**p, "unroll": p["length"]})

    return _top_level_rewritten(jaxpr, consts, step_of)
