"""FSDP layer by layer: a scanned model's stacked parameters gathered one layer at a time.

Inside ``data_parallel``'s ``shard_map`` each device holds a shard of every FSDP
parameter. Gathered whole before the forward, a scanned model's stacked weights
``[L, ...]`` stay gathered (all ``L`` layers) until the backward is done, and their
gradient is an ``[L, ...]`` buffer of the gathered size, reduce-scattered once at the
end. :func:`gathered_per_layer` runs a function of the parameters on their shards
instead: a stacked parameter that a top-level ``lax.scan`` reads as its per-layer input
is gathered inside the loop body, one layer at a time, and the body is checkpointed so
that the backward gathers the layer again rather than keeping it (ZeRO-3 / FSDP's
re-gather). The transpose of each gather is a ``psum_scatter``: each layer's gradient
comes out summed over the devices and sharded. Every other use of a parameter reads it
gathered whole, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import core as jcore
from jax.ad_checkpoint import checkpoint_name

from cannjax._src.core import rewrite as R

GATHERED = "cannjax_fsdp_layer"
"""The ``checkpoint_name`` of a layer's gathered weight: recomputed, never saved."""


def gathered_per_layer(
    fun: Callable[..., Any], dims: Sequence[int | None], axis_name: str
) -> Callable[..., Any]:
    """``fun(flat_params, *rest)`` as a function of the parameters' shards.

    ``dims[i]``: the dimension of ``flat_params[i]`` sharded over ``axis_name`` (None: not
    sharded; passed as it is). The result takes the shards in place of the parameters and
    gives ``fun``'s value; its gradient with respect to a sharded parameter is the shard
    of the gradient summed over ``axis_name`` (the transpose of ``all_gather``).
    """

    def run(shards: Sequence[jax.Array], *rest: Any) -> Any:
        # Traced at gathered shapes; a gather that only a layer loop reads is dead code.
        params = [
            x if d is None else jax.lax.all_gather(x, axis_name, axis=d, tiled=True)
            for x, d in zip(shards, dims)
        ]
        closed, shape = jax.make_jaxpr(fun, return_shape=True)(params, *rest)
        jaxpr = closed.jaxpr
        shard_of = dict(zip(jaxpr.invars, shards))  # the parameters' inputs come first
        dim_of = dict(zip(jaxpr.invars, dims))
        steps = []
        for eqn in jaxpr.eqns:
            local = _layer_inputs(eqn, dim_of)
            if local:
                fn = _scan_gathering(eqn, local, shard_of, axis_name)
                steps.append(R.Call(fn, tuple(eqn.invars), tuple(eqn.outvars), eqn))
            else:
                steps.append(R.Bind(eqn))
        args = [*closed.consts, *params, *jax.tree.leaves(rest)]
        outs = R.run(jaxpr, steps, args)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return run


def _never_the_gather(prim, *_, **params) -> bool:
    """The checkpoint policy of a layer: save what JAX would, but a gathered weight (the
    gather's output and its name both: either would keep the value)."""
    return prim.name != "all_gather" and params.get("name") != GATHERED


def _layer_inputs(eqn: jcore.JaxprEqn, dim_of: dict) -> dict:
    """``{operand position: slice dim}`` of a scan's per-layer inputs that are sharded
    parameters (``dim_of``: a parameter's input var -> its data dimension or None) with
    their data dimension not the layer axis."""
    if eqn.primitive.name != "scan":
        return {}
    first = eqn.params["num_consts"] + eqn.params["num_carry"]
    out = {}
    for k in range(first, len(eqn.invars)):
        v = eqn.invars[k]
        d = dim_of.get(v) if isinstance(v, jcore.Var) else None
        if d is not None and d >= 1:
            out[k] = d - 1
    return out


def _scan_gathering(eqn, local: dict, shard_of: dict, axis_name: str) -> Callable:
    """The scan ``eqn`` as a function of its operands that reads the operands ``local``
    as shards and gathers each layer's slice of them in the body."""
    p = eqn.params
    nc, ncarry = p["num_consts"], p["num_carry"]
    body = jcore.jaxpr_as_fun(p["jaxpr"])

    def layer(consts, carry, x):
        x = list(x)
        for k, d in local.items():
            j = k - nc - ncarry
            w = jax.lax.all_gather(x[j], axis_name, axis=d, tiled=True)
            x[j] = checkpoint_name(w, GATHERED)
        out = body(*consts, *carry, *x)
        return out[:ncarry], out[ncarry:]

    layer = jax.checkpoint(layer, policy=_never_the_gather, prevent_cse=False)

    def run(*args):
        args = [shard_of[eqn.invars[k]] if k in local else a for k, a in enumerate(args)]
        consts, carry, xs = args[:nc], args[nc : nc + ncarry], args[nc + ncarry :]
        carry, ys = jax.lax.scan(
            lambda c, x: layer(consts, c, x),
            carry,
            xs,
            length=p["length"],
            reverse=p["reverse"],
            unroll=p["unroll"],
        )
        outs = [*carry, *ys]
        return outs if len(outs) > 1 else outs[0]  # as R.Call reads its result

    return run
