"""Operator substitution over a whole jaxpr: find the idioms, then run the program with
each replaced by its cannjax operator.

:func:`plan_substitution` walks the equations once per finder, in priority order (the
largest idioms first: attention and losses claim the softmax and projection they contain
before those are considered alone), and keeps a replacement only when the equations it
covers are not claimed already and compute nothing read elsewhere. Bodies of ``lax.scan``
and ``jax.checkpoint`` are planned in place (nested ``jit`` is inlined before).
:meth:`SubPlan.steps` writes the plan as ``core.rewrite`` steps: each replacement is
bound at its last equation, in that equation's source context, so residual names point at
the user's line.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
from jax._src import core as jcore

from cannjax._src.core import jaxpr as J
from cannjax._src.core import rewrite as R
from cannjax._src.core.graph import Graph
from cannjax._src.optimization import idioms
from cannjax._src.optimization.finders import cross_entropy
from cannjax._src.optimization.finders.activation import find_activation
from cannjax._src.optimization.finders.attention import find_attention
from cannjax._src.optimization.finders.dense import find_dense
from cannjax._src.optimization.finders.gated_mlp import find_gated_mlp
from cannjax._src.optimization.finders.lora import find_lora
from cannjax._src.optimization.finders.rms_norm import find_rms_norm
from cannjax._src.optimization.finders.rope import find_rope
from cannjax._src.optimization.finders.verified_norm import find_norm
from cannjax._src.optimization.match import without_repeats
from cannjax._src.optimization.recompute import (
    recompute_producers,
    with_checkpoint,
    with_cotangent_recompute,
)
from cannjax._src.optimization.replacement import Kind, Miss, Replacement
from cannjax._src.optimization.templates import IdiomMatch, match_idiom, template_finder


@dataclasses.dataclass
class LeftAlone:
    """An equation that looks like part of an idiom but was left as it was, and why."""

    primitive: str
    line: str
    reason: str


@dataclasses.dataclass
class Body:
    """An equation whose body (or bodies) had idioms replaced.

    Attributes:
      step: the equation with the new bodies and their constants (``core.rewrite``).
      plan: the plan of its body (of its first searched branch, the others as siblings).
    """

    step: R.Bind
    plan: SubPlan


@dataclasses.dataclass
class SubPlan:
    """How one jaxpr runs with its idioms replaced."""

    jaxpr: jcore.Jaxpr
    replacements: dict  # index of the last covered equation -> Replacement
    skipped: frozenset  # other covered equations
    bodies: dict  # eqn index -> Body
    left: list
    siblings: tuple = ()  # the other branches of a cond, reported with this one
    # index of a reader's last equation (a dense layer, a gated MLP) -> the activation or
    # norm replacement it reads, recomputed in its backward (optimization/recompute.py)
    fed: dict = dataclasses.field(default_factory=dict)
    in_loop: bool = False  # the jaxpr is a loop's body

    def steps(self) -> list[R.Step]:
        """The plan as ``core.rewrite`` steps: replacements as calls, covered equations
        dropped, and so are the equations that read a replaced inner value (nothing reads
        them: the Graph's check that a replacement is private makes them dead)."""
        jaxpr = self.jaxpr
        defined = {*jaxpr.constvars, *jaxpr.invars}
        steps: list[R.Step] = []
        for i, eqn in enumerate(jaxpr.eqns):
            if i in self.skipped:
                continue
            rep = self.replacements.get(i)
            if rep is not None and rep.recomputed:
                continue  # run inside the dense layer that reads it (self.fed)
            if rep is not None:
                call, inputs = rep.call, tuple(rep.inputs)
                if i in self.fed:
                    pair = with_checkpoint if self.in_loop else with_cotangent_recompute
                    call, inputs = pair(self.fed[i], rep)
                steps.append(R.Call(call, inputs, (rep.out,), context=eqn))
                defined.add(rep.out)
                continue
            if any(isinstance(v, jcore.Var) and v not in defined for v in eqn.invars):
                continue
            steps.append(self.bodies[i].step if i in self.bodies else R.Bind(eqn))
            defined.update(eqn.outvars)
        return steps

    def all_replacements(self) -> list[Replacement]:
        """Replacements here and in every body, in program order."""
        return [r for r, _ in self.counted_replacements()]

    def counted_replacements(self, runs: int = 1) -> list[tuple[Replacement, int]]:
        """``(replacement, runs)`` here and in every body, in program order: ``runs`` is
        how often it runs per call, the product of the lengths of the scans around it."""
        out = []
        for i, eqn in enumerate(self.jaxpr.eqns):
            if i in self.replacements:
                out.append((self.replacements[i], runs))
            if i in self.bodies:
                n = eqn.params["length"] if eqn.primitive.name == "scan" else 1
                out.extend(self.bodies[i].plan.counted_replacements(runs * n))
        for other in self.siblings:
            out.extend(other.counted_replacements(runs))
        return out

    def all_left(self) -> list[LeftAlone]:
        out = list(self.left)
        for body in self.bodies.values():
            out.extend(body.plan.all_left())
        for other in self.siblings:
            out.extend(other.all_left())
        return out


def _softmax_at(g: Graph, v):
    if not isinstance(v, jcore.Var) or v not in g.producer:
        return None
    i = g.producer[v][0]
    found = match_idiom(g, i, idioms.SOFTMAX)
    if not isinstance(found, IdiomMatch):
        return None
    m = found.match
    if len(m.inputs) != 1:  # the where= form: its mask is not an attention mask here
        return None
    return found.statics["axis"], m.inputs[0], m.covered


_COMPOSED = ("gelu", "silu")  # activations find_activation verifies
FINDERS: tuple = (
    ("attention", lambda g, i: find_attention(g, i, _softmax_at)),
    ("attention (jax.nn)", template_finder(idioms.ATTENTION)),
    ("loss + z-loss", cross_entropy.find_z_loss),
    ("loss (optax integer labels)", cross_entropy.find_template_loss),
    ("loss (structural)", cross_entropy.find_cross_entropy),
    ("lora", find_lora),
    ("gated mlp", find_gated_mlp),
    ("rope", find_rope),
    ("rms_norm (structural)", find_rms_norm),
    *((d.op, template_finder(d)) for d in idioms.NORMS),
    ("norm (verified by evaluation)", find_norm),
    *((d.op, template_finder(d)) for d in idioms.SOFTMAXES),
    # GELU and SiLU by their templates, then by evaluation, before the single-function
    # templates (tanh, sigmoid) could claim a spelled-out one's inner function.
    *((d.op, template_finder(d)) for d in idioms.ACTIVATIONS if d.op in _COMPOSED),
    ("activation (verified by evaluation)", find_activation),
    *((d.op, template_finder(d)) for d in idioms.ACTIVATIONS if d.op not in _COMPOSED),
    ("dense", find_dense),
)
"""Finders in priority order: ``(name, find(graph, eqn index) -> Replacement | Miss | None)``."""

# Equations worth a line in the report when no idiom took them, with what they were not.
_NORM = "not part of a layer or RMS norm over the last axis as recognized"
_SOFTMAX = "not part of a softmax, logsumexp or cross-entropy over one axis as recognized"
_NOTABLE = {
    "dot_general": "not a dense layer (x @ w, w of rank >= 2) or attention product as recognized",
    "rsqrt": _NORM,
    "sqrt": _NORM,
    "reduce_max": _SOFTMAX,
    "exp": _SOFTMAX,
    "tanh": "not part of an activation as recognized",
    "logistic": "not part of an activation as recognized",
    "erf": "not part of an activation as recognized",
}


# ---------------------------------------------------------------------- planning
STRICT = os.environ.get("CANNJAX_STRICT_FINDERS", "") == "1"
"""Whether a finder that raises stops planning (the test suite sets it) instead of being
reported as a left-alone row: a finder that fails is a bug, never a silent no-match."""


def _last_frame(e: BaseException) -> str:
    """``Type: message (file.py:line in function)`` of the frame that raised ``e``."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" ({Path(tb[-1].filename).name}:{tb[-1].lineno} in {tb[-1].name})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


def plan_substitution(
    jaxpr: jcore.Jaxpr, consts: Sequence[Any] = (), in_loop: bool = False
) -> SubPlan:
    """Finds every idiom in ``jaxpr``, whose leading inputs hold the values ``consts``;
    ``in_loop``: ``jaxpr`` is the body of a loop (``scan``, ``while``)."""
    g = Graph.of(jaxpr, consts)
    claimed: set[int] = set()
    reps: dict[int, Replacement] = {}
    near: dict[int, str] = {}
    for finder, find in FINDERS:
        # From the end: an idiom's last equation is met before its inner ones, which its
        # match then claims (fewer templates tried).
        for i in reversed(range(len(jaxpr.eqns))):
            if i in claimed:
                continue
            try:
                found = find(g, i)
            except Exception as e:  # a finder bug: raised under tests, reported otherwise
                if STRICT:
                    raise
                why = f"finder {finder!r} failed, a cannjax bug: {_last_frame(e)}"
                near.setdefault(i, why)
                continue
            if isinstance(found, Miss):
                near.setdefault(i, found.reason)
                continue
            if found is None:
                continue
            if found.covered & claimed:
                continue
            last = max(found.covered)
            if not g.private(set(found.covered), [found.out]):
                near.setdefault(last, f"{found.op}: a value inside it is also read elsewhere")
                continue
            problem = _check_call(found)
            if problem is not None:
                near.setdefault(last, f"{found.op}: {problem}")
                continue
            found.line = J.user_line(jaxpr.eqns[last])
            if found.kind in (
                Kind.DENSE,
                Kind.LORA,
                Kind.ATTENTION,
            ):  # name the code it was found in
                func = J.source_line(jaxpr.eqns[last]).rpartition(" (")[2].rstrip(")")
                if func and func != "?":
                    found.source = f"{found.source} in {func}"
            reps[last] = found
            claimed |= found.covered
    bodies = {}
    left = []
    for i, eqn in enumerate(jaxpr.eqns):
        if i in claimed:
            continue
        if R.has_bodies(eqn):
            try:
                body = _plan_body(eqn, in_loop)
            except Exception as e:
                if STRICT:
                    raise
                why = f"body not searched, a cannjax bug: {_last_frame(e)}"
                left.append(LeftAlone(eqn.primitive.name, J.user_line(eqn), why))
                continue
            if body is not None:
                bodies[i] = body
            continue
        custom = eqn.primitive.name == "custom_vjp_call" or (
            eqn.primitive.name == "custom_jvp_call" and J.kind_of(eqn)[0] == "kept"
        )
        if custom and i not in near:
            # Replacing inside would silently drop the user's own derivative rule.
            reason = f"{eqn.primitive.name[:10]} rule: its body is left as written"
            left.append(LeftAlone(eqn.primitive.name, J.user_line(eqn), reason))
        elif i in near:
            left.append(LeftAlone(eqn.primitive.name, J.user_line(eqn), near[i]))
        elif (
            eqn.primitive.name in _NOTABLE
            and J.is_float(eqn.outvars[0].aval.dtype)
            and i not in g.constant  # sqrt(head_dim): computed from literals, not data
        ):
            reason = _NOTABLE[eqn.primitive.name] + " (docs/optimize.md)"
            left.append(LeftAlone(eqn.primitive.name, J.user_line(eqn), reason))
    skipped = frozenset(claimed - set(reps))
    fed = recompute_producers(g, reps, in_loop)
    return SubPlan(jaxpr, reps, skipped, bodies, left, fed=fed, in_loop=in_loop)


def _check_call(rep: Replacement) -> Miss | None:
    """Why the replacement cannot stand in for its output (None when it can)."""
    avals = [J.sds(a.aval) if a is not None else None for a in rep.inputs]
    try:
        out = jax.eval_shape(lambda *xs: rep.call(*xs), *avals)
    except (TypeError, ValueError) as e:  # the operators' own input checks
        return Miss(f"cannjax's operator refuses these inputs ({type(e).__name__}: {e})")
    want = rep.out.aval
    if tuple(out.shape) != tuple(want.shape) or out.dtype != want.dtype:
        got, need = f"{out.dtype}{list(out.shape)}", f"{want.dtype}{list(want.shape)}"
        return Miss(f"cannjax's operator gives {got}, not {need}")
    return None


def _search(closed: jcore.ClosedJaxpr, in_loop: bool):
    """``(jaxpr, extra, SubPlan)`` for a body with idioms (None without): ``jaxpr`` takes
    the constants ``extra`` before the body's own inputs."""
    jaxpr, consts = without_repeats(*R.normalize(closed))
    sub = plan_substitution(jaxpr, consts, in_loop)
    if not sub.all_replacements():
        return None
    new_jaxpr, new_consts = R.retrace(jaxpr, sub.steps())
    return new_jaxpr, (*new_consts, *consts), sub


def _plan_body(eqn, in_loop: bool = False) -> Body | None:
    """The bodies of a ``scan``, ``jax.checkpoint``, ``while`` (its loop body) or ``cond``
    (each branch) with their idioms replaced, or None when none has any."""
    loop = in_loop or eqn.primitive.name in ("scan", "while")
    found = [_search(b, loop) for b in R.bodies(eqn)]
    if all(f is None for f in found):
        return None
    step = R.with_bodies(eqn, [None if f is None else f[:2] for f in found])
    subs = [f[2] for f in found if f is not None]
    return Body(step, dataclasses.replace(subs[0], siblings=tuple(subs[1:])))


def run_substitution(plan: SubPlan, args: Sequence[Any]) -> list:
    """Evaluates ``plan`` at ``args`` (constants first, as in ``plan.jaxpr``'s inputs)."""
    return R.run(plan.jaxpr, plan.steps(), args)
