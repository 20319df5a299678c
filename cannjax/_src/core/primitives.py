"""The two primitives every cannjax operator is bound through.

An operator is a :class:`Rule`: a forward that returns outputs and residuals, a tangent
rule (linear in the tangents) and a hand-written backward (its transpose). It enters a
program as ``op_p`` (the forward) and, once differentiated, as ``lin_p`` (the tangent
map, linear in its tangent inputs). Why two primitives and not ``jax.custom_vjp``:

* ``jax.custom_vjp`` rejects forward mode (jvp, jacfwd, linearize) in jax 0.10.2.
* ``op_p``'s JVP rule binds ``op_p`` again with ``residuals=True`` (the same forward,
  which then also returns its residuals), names the residuals with ``checkpoint_name``
  and emits ``lin_p(residuals, tangents)``. Forward mode evaluates ``lin_p`` with the
  tangent rule; reverse mode transposes ``lin_p``, and the transpose rule *is* the
  hand-written backward. Residuals are exactly what ``lin_p`` consumes, so the forward
  decides what the backward keeps.
* Every order stays on the op's own rules: the primal output inside a JVP is ``op_p``
  itself, so an outer transform differentiates it with the tangent rule again (never the
  forward's plain-JAX math). A residual that is an input or an output of the forward
  takes that value's tangent; only the residuals the forward computes besides (a row's
  mean, say) are differentiated through the forward's own code.
* ``lin_p``'s own JVP (needed by jacfwd-of-jacfwd and jacrev-of-jacfwd) is
  ``lin_p(res, dt) + d/dres tangent(res, t)``: linear in ``dt`` through ``lin_p`` again,
  so the hand-written backward keeps running at every order.
* Batching re-binds the same primitive with a :class:`Rule` whose functions are
  ``jax.vmap``-ed, so vmap-then-grad still runs the hand-written backward.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import api_util, dispatch, source_info_util
from jax._src.interpreters import partial_eval as pe
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir


@dataclasses.dataclass(frozen=True, eq=False)
class Rule:
    """One operator at fixed static arguments, in the flat form the primitives need.

    Attributes:
      name: operator name; residuals are named ``cannjax.<name>.<key>``.
      forward: ``(*args) -> (outs: list, residuals: pytree)``.
      tangent: ``(residuals, tangents: list) -> outs: list``; linear in ``tangents``.
      backward: ``(residuals, cotangents: list) -> list``, one cotangent per
        differentiable argument.
      diff: for each argument, whether it is differentiable (others get no tangent).
    """

    name: str
    forward: Callable[..., tuple[list, Any]]
    tangent: Callable[[Any, list], list]
    backward: Callable[[Any, list], list]
    diff: tuple[bool, ...]

    def __repr__(self) -> str:
        return f"Rule({self.name})"


op_p = Primitive("cannjax_op")
op_p.multiple_results = True
lin_p = Primitive("cannjax_lin")
lin_p.multiple_results = True


def bind(rule: Rule, *args: jax.Array) -> list[jax.Array]:
    """Applies ``rule`` to ``args``; returns the list of outputs."""
    return op_p.bind(*args, rule=rule, residuals=False)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where each flat residual of a forward comes from.

    ``sources[k]`` is ``("in", i)`` (argument ``i`` itself), ``("out", j)`` (output
    ``j`` itself) or ``("own", k)`` (a value the forward computes only to keep).
    """

    tree: Any
    sources: tuple[tuple[str, int], ...]


def _signature(args) -> tuple:
    return tuple((a.shape, a.dtype, a.weak_type) for a in map(jax.typeof, args))


@functools.lru_cache(maxsize=4096)
def _layout(rule: Rule, signature: tuple) -> _Layout:
    structs = [jax.ShapeDtypeStruct(s, d, weak_type=w) for s, d, w in signature]
    closed, (_, res_shape) = jax.make_jaxpr(rule.forward, return_shape=True)(*structs)
    jaxpr = closed.jaxpr
    n_out = len(jaxpr.outvars) - len(jax.tree_util.tree_leaves(res_shape))
    ins = {v: i for i, v in enumerate(jaxpr.invars)}
    outvars = [_forwarded(jaxpr, v) for v in jaxpr.outvars]
    outs = {v: j for j, v in enumerate(outvars[:n_out]) if isinstance(v, jcore.Var)}
    sources = []
    for k, v in enumerate(outvars[n_out:]):
        if isinstance(v, jcore.Var) and v in ins:
            sources.append(("in", ins[v]))
        elif isinstance(v, jcore.Var) and v in outs:
            sources.append(("out", outs[v]))
        else:
            sources.append(("own", k))
    return _Layout(jax.tree_util.tree_structure(res_shape), tuple(sources))


# ---------------------------------------------------------------- evaluation and shapes
def _forwarded(jaxpr, var):
    """``var``, or the outer variable it is when a nested jit merely passes it through (a
    forward under ``jax.jit`` returns its input as a new variable of the jit equation)."""
    producers = {o: e for e in jaxpr.eqns for o in e.outvars}
    while isinstance(var, jcore.Var) and var in producers:
        eqn = producers[var]
        inner = eqn.params.get("jaxpr")
        if eqn.primitive.name not in ("pjit", "jit", "closed_call") or inner is None:
            break
        inner = getattr(inner, "jaxpr", inner)
        out = inner.outvars[eqn.outvars.index(var)]
        if out not in inner.invars:
            break
        var = eqn.invars[inner.invars.index(out)]
    return var


def _forward_outs(*args, rule, residuals):
    # With residuals: the outputs, then every flat residual. The JVP uses only those the
    # forward computes besides (the others it takes from the inputs and outputs; the
    # copies are dead code), but the count must not depend on the layout, which a
    # batched rule's forward changes (vmap broadcasts an unbatched input it keeps).
    outs, res = rule.forward(*args)
    return [*outs, *jax.tree_util.tree_leaves(res)] if residuals else list(outs)


def _tangent_outs(*args, rule, res_tree):
    res, ts = _split_lin_args(args, res_tree)
    return list(rule.tangent(res, ts))


def _split_lin_args(args, res_tree):
    n = res_tree.num_leaves
    return jax.tree_util.tree_unflatten(res_tree, args[:n]), list(args[n:])


@functools.lru_cache(maxsize=4096)
def _abstract(fun, avals, params):
    # Tracing with the avals themselves (not ShapeDtypeStructs) keeps shard_map's
    # varying-axis types and shardings on the outputs.
    kwargs = dict(params)
    dbg = api_util.debug_info("cannjax", fun, avals, {})
    return pe.abstract_eval_fun(functools.partial(fun, **kwargs), *avals, debug_info=dbg)


op_p.def_impl(functools.partial(dispatch.apply_primitive, op_p))
op_p.def_abstract_eval(
    lambda *avals, rule, residuals: _abstract(
        _forward_outs, avals, (("rule", rule), ("residuals", residuals))
    )
)
mlir.register_lowering(op_p, mlir.lower_fun(_forward_outs, multiple_results=True))

lin_p.def_impl(functools.partial(dispatch.apply_primitive, lin_p))
lin_p.def_abstract_eval(
    lambda *avals, rule, res_tree: _abstract(
        _tangent_outs, avals, (("rule", rule), ("res_tree", res_tree))
    )
)
mlir.register_lowering(lin_p, mlir.lower_fun(_tangent_outs, multiple_results=True))


# ---------------------------------------------------------------- differentiation
def _zeros_to_arrays(ts: Sequence[Any]) -> list:
    return [ad.instantiate_zeros(t) if type(t) is ad.Zero else t for t in ts]


def _as_arrays(xs: Sequence[Any]) -> list:
    """``xs`` with Python scalars made (weakly typed) arrays; symbolic zeros kept.

    A JVP rule can receive a Python float as a primal or tangent (the inner tangent of
    nested ``jax.jvp`` calls, or ``check_grads`` at a Python scalar point); the rules
    read ``.dtype`` and ``.shape`` of every value."""
    return [x if isinstance(x, (jax.Array, ad.Zero)) else jnp.asarray(x) for x in xs]


def _zero_like(x) -> ad.Zero:
    """The symbolic zero tangent of the primal ``x``."""
    return ad.Zero(jax.typeof(x).to_tangent_aval())


def _op_jvp(primals, tangents, *, rule, residuals):
    primals, tangents = _as_arrays(primals), _as_arrays(tangents)
    # A non-differentiable argument has no derivative at any order: its tangent is
    # dropped here, so that a residual which is that argument carries none to an outer
    # transform either (the op is f(x, stop_gradient(w)), as its reference).
    tangents = [
        t if d or type(t) is ad.Zero else _zero_like(p)
        for p, t, d in zip(primals, tangents, rule.diff)
    ]
    layout = _layout(rule, _signature(primals))
    both = op_p.bind(*primals, rule=rule, residuals=True)
    n_out = len(both) - len(layout.sources)
    outs, computed = list(both[:n_out]), both[n_out:]
    picked = {"in": primals, "out": outs, "own": computed}
    flat = [picked[kind][i] for kind, i in layout.sources]
    res = _name_residuals(rule.name, jax.tree_util.tree_unflatten(layout.tree, flat), layout)
    # Only the arguments with a tangent reach lin_p: a symbolic zero (an argument that
    # is not differentiated, a weight closed over) is neither made an array nor saved
    # for the backward, whose cotangent for it is never asked for.
    live = tuple(d and type(t) is not ad.Zero for t, d in zip(tangents, rule.diff))
    if any(live):
        lin_rule = rule if live == rule.diff else _restricted(rule, live, _tangent_avals(primals))
        ts = [t for t, k in zip(tangents, live) if k]
        touts = lin_p.bind(
            *jax.tree_util.tree_leaves(res), *ts, rule=lin_rule, res_tree=layout.tree
        )
    else:
        touts = [_zero_like(o) for o in outs]
    if not residuals:
        return outs, touts
    # An outer transform of an inner JVP: a residual that is an input or output has that
    # value's tangent; one the forward computes besides is differentiated through the
    # forward's own code.
    own = _own_tangents(rule, layout, primals, tangents, computed)
    picked = {"in": tangents, "out": touts, "own": own}
    t_res = [picked[kind][i] for kind, i in layout.sources]
    return [*outs, *flat], [*touts, *t_res]


def _tangent_avals(primals) -> tuple:
    return tuple((tuple(a.shape), a.dtype) for a in map(jax.typeof, primals))


@functools.lru_cache(maxsize=4096)
def _restricted(rule: Rule, live: tuple, avals: tuple) -> Rule:
    """``rule`` with tangents only for the arguments marked ``live`` (a subset of
    ``rule.diff``): its tangent rule takes zeros for the others, made inside it (never
    a residual), and its backward returns the cotangents of the live ones only (the
    others are dead code under ``jit``). ``avals``: ``(shape, dtype)`` per argument."""
    diff_idx = [i for i, d in enumerate(rule.diff) if d]
    keep = [k for k, i in enumerate(diff_idx) if live[i]]

    def tangent(res, ts):
        it = iter(ts)
        full = [next(it) if live[i] else jnp.zeros(*avals[i]) for i in diff_idx]
        return rule.tangent(res, full)

    def backward(res, cts):
        cts = list(rule.backward(res, cts))
        return [cts[k] for k in keep]

    return Rule(rule.name, rule.forward, tangent, backward, live)


def _own_tangents(rule, layout, primals, tangents, computed) -> dict:
    own = [k for kind, k in layout.sources if kind == "own"]
    diff = [i for i, t in enumerate(tangents) if type(t) is not ad.Zero]
    if not own:
        return {}
    if not diff:
        return {k: _zero_like(computed[k]) for k in own}

    def own_of(*d):
        full = list(primals)
        for i, v in zip(diff, d):
            full[i] = v
        flat = jax.tree_util.tree_leaves(rule.forward(*full)[1])
        return [flat[k] for k in own]

    _, t_own = jax.jvp(own_of, [primals[i] for i in diff], [tangents[i] for i in diff])
    return dict(zip(own, t_own))


# A residual's description ("named 'cannjax.softmax.y' from model.py:12 (loss)") names
# the first frame outside cannjax, the user's call of the op, not this function: jax
# skips cannjax's files in source locations as it skips its own.
_PACKAGE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
source_info_util.register_exclusion(_PACKAGE + os.sep)


def _name_residuals(op_name, res, layout):
    # A residual that *is* one of the op's inputs keeps its identity, unnamed: a
    # checkpoint_name would make it a new value that JAX can no longer forward, so
    # lax.scan would stack a copy of every layer's weight (64 MiB for a 16-layer
    # 1024-wide stack) and jit would return a copy. Its producer decides its fate.
    paths, tree = jax.tree_util.tree_flatten_with_path(res)
    named = []
    for (path, v), (kind, _) in zip(paths, layout.sources):
        key = path[0].key if isinstance(res, dict) else None
        if kind == "in":
            named.append(v)
        else:
            named.append(checkpoint_name(v, f"cannjax.{op_name}" + (f".{key}" if key else "")))
    return jax.tree_util.tree_unflatten(tree, named)


def _lin_transpose(cts, *args, rule, res_tree):
    n = res_tree.num_leaves
    if any(ad.is_undefined_primal(r) for r in args[:n]):
        raise NotImplementedError(f"cannjax.{rule.name}: residuals must be known in transpose")
    res = jax.tree_util.tree_unflatten(res_tree, args[:n])
    in_cts = rule.backward(res, _zeros_to_arrays(cts))
    out = [None] * n
    for t, ct in zip(args[n:], in_cts):
        out.append(_match_aval(ct, t.aval) if ad.is_undefined_primal(t) else None)
    return out


def _match_aval(ct, aval):
    # The backward works in the input's dtype; guard against silent promotion.
    return ct.astype(aval.dtype) if ct.dtype != aval.dtype else ct


def _lin_jvp(primals, tangents, *, rule, res_tree):
    primals, tangents = _as_arrays(primals), _as_arrays(tangents)
    n = res_tree.num_leaves
    out = lin_p.bind(*primals, rule=rule, res_tree=res_tree)
    ts, dres, dts = primals[n:], tangents[:n], tangents[n:]
    # Linear in the tangent inputs: that part goes through lin_p again.
    d_out = lin_p.bind(*primals[:n], *_zeros_to_arrays(dts), rule=rule, res_tree=res_tree)
    if any(type(d) is not ad.Zero for d in dres):
        res = jax.tree_util.tree_unflatten(res_tree, primals[:n])
        dres_tree = jax.tree_util.tree_unflatten(res_tree, _zeros_to_arrays(dres))
        _, d_res_part = jax.jvp(lambda r: list(rule.tangent(r, list(ts))), (res,), (dres_tree,))
        d_out = [a + b for a, b in zip(d_out, d_res_part)]
    return out, d_out


ad.primitive_jvps[op_p] = _op_jvp
ad.primitive_jvps[lin_p] = _lin_jvp
ad.primitive_transposes[lin_p] = _lin_transpose


# ---------------------------------------------------------------- batching
def _to_front(x, d):
    return x if d is None else jnp.moveaxis(x, d, 0)


@functools.lru_cache(maxsize=4096)
def _batched_rule(rule: Rule, in_axes: tuple, res_axes: tuple | None) -> Rule:
    """``rule`` under ``jax.vmap``: arguments batched on axis 0 where ``in_axes`` is 0.

    ``res_axes`` gives the batch axis of each flat residual (``None``: all on axis 0, as
    the batched forward produces them). Outputs are always batched on axis 0; the
    cotangent of an unbatched argument is summed over the batch.
    """
    d_axes = [a for a, d in zip(in_axes, rule.diff) if d]

    def res_prefix(res):
        if res_axes is None:
            return 0
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(res), list(res_axes))

    def forward(*args):
        return jax.vmap(rule.forward, in_axes=in_axes, out_axes=0)(*args)

    def tangent(res, ts):
        return jax.vmap(rule.tangent, in_axes=(res_prefix(res), d_axes), out_axes=0)(res, ts)

    def backward(res, cts):
        in_cts = jax.vmap(rule.backward, in_axes=(res_prefix(res), 0), out_axes=0)(res, cts)
        return [c if a is not None else c.sum(0) for c, a in zip(in_cts, d_axes)]

    return Rule(rule.name, forward, tangent, backward, rule.diff)


def _op_batch(args, dims, *, rule, residuals):
    axes = tuple(None if d is None else 0 for d in dims)
    args = [_to_front(a, d) for a, d in zip(args, dims)]
    outs = op_p.bind(*args, rule=_batched_rule(rule, axes, None), residuals=residuals)
    return outs, [0] * len(outs)


def _lin_batch(args, dims, *, rule, res_tree):
    n = res_tree.num_leaves
    axes = [None if d is None else 0 for d in dims]
    args = [_to_front(a, d) for a, d in zip(args, dims)]
    # Rebuild full in_axes (non-differentiable arguments do not reach lin_p).
    t_axes = iter(axes[n:])
    in_axes = tuple(next(t_axes) if d else None for d in rule.diff)
    new_rule = _batched_rule(rule, in_axes, tuple(axes[:n]))
    outs = lin_p.bind(*args, rule=new_rule, res_tree=res_tree)
    return outs, [0] * len(outs)


batching.primitive_batchers[op_p] = _op_batch
batching.primitive_batchers[lin_p] = _lin_batch
