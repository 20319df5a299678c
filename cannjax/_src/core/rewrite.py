"""Rewriting a jaxpr: the one layer under fuse, optimize and the level-3 budget.

Each transform decides what to change in a (normalized) jaxpr and writes the new program
down as a list of *steps*, run in order, each reading the values of the steps before it:

* :class:`Bind`: an equation, as written or with new parameters and extra operands (a
  ``scan``, ``while``, ``cond`` or ``jax.checkpoint`` whose body was rewritten and takes
  constants: :func:`with_bodies`);
* :class:`Call`: a function that computes some of the program's values from others (a
  fused cluster, an idiom's operator).

:func:`run` is the interpreter loop (at concrete values or under a trace) and
:func:`retrace` turns the steps into a new jaxpr. Every jaxpr handed around goes through
:func:`normalize` first: no constvars (constants lead the inputs), ``jit`` inlined.
``health`` reads programs without rewriting them, with :func:`cannjax._src.core.jaxpr.walk`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import core as jcore
from jax._src.interpreters import partial_eval as pe

from cannjax._src.core import jaxpr as J


@dataclasses.dataclass(frozen=True)
class Bind:
    """Equation ``eqn`` bound to its operands, with ``extra`` inserted at ``position``.

    Attributes:
      eqn: the equation.
      params: its new parameters (None: as written).
      extra: values inserted before operand ``position`` (a rewritten body's constants).
      position: where ``extra`` goes.
    """

    eqn: jcore.JaxprEqn
    params: dict | None = None
    extra: tuple = ()
    position: int = 0


@dataclasses.dataclass(frozen=True)
class Call:
    """``outputs = fn(*inputs)``: a function standing for the equations that made ``outputs``.

    Attributes:
      fn: returns the value of the one output, or a sequence, one per output.
      inputs: the atoms it reads (``None`` hands it ``None``: an absent bias, say).
      outputs: the variables it defines.
      context: the equation whose source context it is bound in (so the names of the
        residuals it saves point at the user's line), or None.
    """

    fn: Callable[..., Any]
    inputs: tuple
    outputs: tuple
    context: jcore.JaxprEqn | None = None


Step = Bind | Call


def normalize(closed: jcore.ClosedJaxpr) -> tuple[jcore.Jaxpr, tuple]:
    """``closed`` as a jaxpr without constvars (constants lead its inputs), jit inlined.

    Returns the jaxpr and the constants to pass before the original inputs.
    """
    if J.has_inlinable_jit(closed.jaxpr):
        inlined = J.inline_jit(closed)  # inputs: closed's consts, then closed's inputs
        return pe.convert_constvars_jaxpr(inlined.jaxpr), (*inlined.consts, *closed.consts)
    if closed.jaxpr.constvars:
        return pe.convert_constvars_jaxpr(closed.jaxpr), tuple(closed.consts)
    return closed.jaxpr, ()


def as_written(jaxpr: jcore.Jaxpr) -> list[Step]:
    """The steps that run ``jaxpr`` unchanged."""
    return [Bind(eqn) for eqn in jaxpr.eqns]


def run(jaxpr: jcore.Jaxpr, steps: Sequence[Step], args: Sequence[Any]) -> list:
    """Evaluates ``steps`` with ``jaxpr``'s inputs (constvars first) bound to ``args``;
    returns the values of ``jaxpr``'s outputs."""
    env = dict(zip((*jaxpr.constvars, *jaxpr.invars), args))

    def read(v: Any) -> Any:
        return None if v is None else J.read_atom(env, v)

    for step in steps:
        if isinstance(step, Call):
            scope = J.eqn_context(step.context) if step.context else contextlib.nullcontext()
            with scope:
                outs = step.fn(*map(read, step.inputs))
            env.update(zip(step.outputs, [outs] if len(step.outputs) == 1 else outs))
        else:
            invals = list(map(read, step.eqn.invars))
            invals[step.position : step.position] = step.extra
            env.update(zip(step.eqn.outvars, J.bind_eqn(step.eqn, invals, step.params)))
    return [read(v) for v in jaxpr.outvars]


def retrace(jaxpr: jcore.Jaxpr, steps: Sequence[Step]) -> tuple[jcore.Jaxpr, tuple]:
    """The steps as a normalized jaxpr with ``jaxpr``'s inputs; returns it and the constants
    that lead its inputs (values the steps captured: an operator's weights, say)."""
    avals = [v.aval for v in (*jaxpr.constvars, *jaxpr.invars)]
    return normalize(J.trace(lambda *a: run(jaxpr, steps, a), avals))


# ---------------------------------------------------------------------- bodies
# Equations whose bodies run as part of the program: the parameter holding each body.
_BODIES = {"scan": "jaxpr", "while": "body_jaxpr", "cond": "branches",
           "remat2": "jaxpr", "checkpoint": "jaxpr"}  # fmt: skip


def has_bodies(eqn: jcore.JaxprEqn) -> bool:
    """Whether ``eqn`` is a ``scan``, ``while`` (its loop body), ``cond`` or checkpoint."""
    return eqn.primitive.name in _BODIES


def bodies(eqn: jcore.JaxprEqn) -> list[jcore.ClosedJaxpr]:
    """The bodies of ``eqn`` that may be rewritten: a ``scan``'s, a ``while``'s loop body,
    each branch of a ``cond``, a checkpoint's."""
    body = eqn.params[_BODIES[eqn.primitive.name]]
    out = list(body) if eqn.primitive.name == "cond" else [body]
    return [b if isinstance(b, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(b, ()) for b in out]


def with_bodies(eqn: jcore.JaxprEqn, new: Sequence[tuple[jcore.Jaxpr, tuple] | None]) -> Bind:
    """``eqn`` with its bodies (as :func:`bodies` lists them) replaced.

    ``new[i]`` is ``(jaxpr, extra)`` for a rewritten body: a normalized jaxpr taking the
    constants ``extra`` before the body's own inputs; None keeps body ``i``. The constants
    become operands of ``eqn``: the leading constants of a ``scan``, checkpoint or cond
    branch, or the loop body's of a ``while``.
    """
    name = eqn.primitive.name
    p = dict(eqn.params)
    if name == "cond":
        return _with_branches(eqn, p, new)
    ((jaxpr, extra),) = new
    if name == "scan":
        p["jaxpr"] = jcore.ClosedJaxpr(jaxpr, ())
        p["num_consts"] = p["num_consts"] + len(extra)
        if "linear" in p:
            p["linear"] = (False,) * len(extra) + tuple(p["linear"])
        return Bind(eqn, p, tuple(extra), 0)
    if name == "while":
        p["body_jaxpr"] = jcore.ClosedJaxpr(jaxpr, ())
        p["body_nconsts"] = p["body_nconsts"] + len(extra)
        return Bind(eqn, p, tuple(extra), p["cond_nconsts"])
    p["jaxpr"] = jaxpr  # checkpoint: an open jaxpr
    return Bind(eqn, p, tuple(extra), 0)


def _with_branches(eqn, p, new) -> Bind:
    # Every branch takes the same operands: the index, all branches' constants, then the
    # cond's own operands; each rewritten branch reads its own slice of the constants.
    extra = tuple(x for n in new if n is not None for x in n[1])
    count = len(extra)
    avals = [J.sds(jax.typeof(x)) for x in extra] + [
        J.sds(v.aval) for v in p["branches"][0].jaxpr.invars
    ]

    def branch(body, lo, k, *a):
        return jcore.jaxpr_as_fun(body)(*a[lo : lo + k], *a[count:])

    branches, start = [], 0
    for old, n in zip(p["branches"], new):
        if n is None:
            run_it = functools.partial(branch, old, 0, 0)
        else:
            k = len(n[1])
            run_it = functools.partial(branch, jcore.ClosedJaxpr(n[0], ()), start, k)
            start += k
        branches.append(jax.make_jaxpr(run_it)(*avals))
    p["branches"] = tuple(branches)
    return Bind(eqn, p, extra, 1)
