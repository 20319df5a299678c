"""Producers recomputed in their readers' backward: an activation or a norm run together
with the dense layers (or gated MLPs) that read its output.

An activation's output is the saved input of the dense layer that reads it, and its own
backward saves the activation's input as well: two ``[..., F]`` residuals per MLP, where
one suffices. A norm's output is likewise the saved input of the projections that read
it (q, k, v; an MLP's first layer or a gated MLP), while the norm's backward saves its
input, the residual stream. Run with its reader, the producer saves only its input (and
the weights); the backward recomputes it (elementwise, or a row reduction).

How the recomputation stays in the backward depends on where the pair is:

* In a loop body (a scanned model's layer) the forward and the backward are separate
  loops: the pair runs under ``jax.checkpoint`` (:func:`with_checkpoint`), activations and
  norms alike.
* In layers written out one after another, XLA:CPU undoes ``jax.checkpoint``: it removes
  optimization barriers before it merges common subexpressions, so the recomputed value
  is the forward's own again, alive beside the saved input (the compiled temp of an
  unrolled flax.nnx GPT's gradient rose from 402 to 488 MiB). There an activation runs
  with its dense reader as one operator (:func:`with_cotangent_recompute`) whose backward
  recomputes the activation from its input plus zeros made from the reader's cotangent:
  a value XLA cannot merge with the forward's, nor compute before the cotangent exists.
  Norms are left unpaired there: each of a norm's readers would recompute it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax._src import core as jcore

from cannjax._src.core import jaxpr as J
from cannjax._src.core.graph import Graph
from cannjax._src.core.primitives import Rule, bind
from cannjax._src.ops.attention import zeros_after
from cannjax._src.optimization.replacement import Kind, Replacement
from cannjax._src.remat.policies import save_operator_residuals

IN_LOOP = ((Kind.ACTIVATION, Kind.NORM), (Kind.DENSE, Kind.GATED))
"""(producer kinds, reader kinds) paired in a loop body."""
UNROLLED = ((Kind.ACTIVATION,), (Kind.DENSE,))
"""(producer kinds, reader kinds) paired elsewhere."""


def recompute_producers(g: Graph, reps: dict, in_loop: bool) -> dict:
    """``{reader index: producer}``: each producer whose output only its readers read,
    each reading it once; marks those producers ``recomputed`` (each reader recomputes
    it in its backward). Outside a loop body a reader must keep the producer's rows
    (``[..., F] -> [..., D]``): its cotangent's rows make the zeros."""
    kinds, reader_kinds = IN_LOOP if in_loop else UNROLLED
    producers = {r.out: r for r in reps.values() if r.kind in kinds}
    readers: dict = {}
    for i, d in reps.items():
        if d.kind in reader_kinds:
            for x in {x for x in d.inputs if isinstance(x, jcore.Var) and x in producers}:
                readers.setdefault(x, []).append(i)
    fed = {}
    for out, idx in readers.items():
        ds = [reps[i] for i in idx]
        if out in g.outvars or any(sum(x is out for x in d.inputs) != 1 for d in ds):
            continue
        if any(not any(u in d.covered for d in ds) for u in g.consumers(out)):
            continue
        if any(sum(x in producers for x in d.inputs if isinstance(x, jcore.Var)) != 1 for d in ds):
            continue  # a reader of two producers would recompute one and miss the other
        if not in_loop and (
            not isinstance(producers[out].inputs[0], jcore.Var)
            or any(d.out.aval.shape[:-1] != out.aval.shape[:-1] for d in ds)
        ):
            continue
        producers[out].recomputed = True
        fed.update(dict.fromkeys(idx, producers[out]))
    return fed


def _pair(a: Replacement, d: Replacement) -> tuple[Callable[..., Any], tuple]:
    """``(fn, inputs)``: reader ``d`` applied to producer ``a``'s output, as a function
    of ``a``'s inputs, then ``d``'s other inputs."""
    n = len(a.inputs)

    def fn(*vals):
        y = a.call(*vals[:n])
        rest = iter(vals[n:])
        return d.call(*(y if x is a.out else next(rest) for x in d.inputs))

    return fn, (*a.inputs, *(x for x in d.inputs if x is not a.out))


def with_checkpoint(a: Replacement, d: Replacement) -> tuple[Callable[..., Any], tuple]:
    """``(call, inputs)`` of the pair under ``jax.checkpoint`` (in a loop body)."""
    fn, inputs = _pair(a, d)
    return functools.partial(jax.checkpoint, policy=save_operator_residuals)(fn), inputs


def with_cotangent_recompute(a: Replacement, d: Replacement) -> tuple[Callable[..., Any], tuple]:
    """``(call, inputs)`` of the pair as one operator (``core.primitives``: its own
    tangent and backward rules, so forward mode and every order work). It saves the
    pair's inputs; its backward recomputes the activation at ``x + z``, ``z`` zeros per
    row made from the cotangent (:func:`cannjax._src.ops.attention.zeros_after`,
    elementwise, then a maximum over the row: local to each device's rows), and runs
    the pair's own backward there. ``x + 0`` is ``x``: the gradients are the unpaired
    ones to the last bit, but for XLA fusing the recomputed activation differently."""
    fn, inputs = _pair(a, d)
    # Absent atoms (a bias of None) stay out of the operator; literals are constants.
    held = [i for i, x in enumerate(inputs) if isinstance(x, jcore.Var)]
    diff = tuple(J.is_float(inputs[i].aval.dtype) for i in held)

    def full(vals):
        out = [x.val if isinstance(x, jcore.Literal) else x for x in inputs]
        for i, v in zip(held, vals):
            out[i] = v
        return out

    def forward(*vals):
        return [fn(*full(vals))], {"inputs": list(vals)}

    def of_diff(vals):
        """``fn`` as a function of the differentiable inputs, the others fixed."""

        def g(*dv):
            it = iter(dv)
            return fn(*full([next(it) if k else v for v, k in zip(vals, diff)]))

        return g, [v for v, k in zip(vals, diff) if k]

    def tangent(res, ts):
        g, primals = of_diff(res["inputs"])
        return [jax.jvp(g, tuple(primals), tuple(ts))[1]]

    def backward(res, cts):
        vals = list(res["inputs"])
        (ct,) = cts
        z = zeros_after(ct).max(-1, keepdims=True)
        vals[0] = vals[0] + z.astype(vals[0].dtype)  # the activation's input
        g, primals = of_diff(vals)
        return list(jax.vjp(g, *primals)[1](ct))

    rule = Rule(f"recomputed_{a.op}_{d.op}", forward, tangent, backward, diff)

    def call(*vals):
        (out,) = bind(rule, *(vals[i] for i in held))
        return out

    return call, inputs
