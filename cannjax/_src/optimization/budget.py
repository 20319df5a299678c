"""Level 3 of ``optimize``: checkpoint the scanned layers to fit a memory budget.

The candidates, from least to most recomputation, are: nothing checkpointed; the body of
every ``lax.scan`` checkpointed saving only the output and row statistics of attention
(``cannjax.attention.out`` and ``.lse``: the backward then re-runs the cheap dense layers,
norms and activations of a layer, never its attention forward); the body of every scan
checkpointed saving nothing (what ``jax.checkpoint`` on every layer does). Each is
compiled as the gradient of the program's scalar output with respect to its floating
inputs, and the first whose compiled temp memory fits the budget is used. The figures are
measured, not modelled, so a chosen plan is within budget by construction.
"""

from __future__ import annotations

import dataclasses

import jax
from jax._src import core as jcore

from cannjax._src.core import jaxpr as J
from cannjax._src.core import rewrite as R
from cannjax._src.remat.policies import save_names

POLICIES = (
    ("none", None),
    ("layers, saving attention", save_names("cannjax.attention.out", "cannjax.attention.lse")),
    ("layers, saving nothing", jax.checkpoint_policies.nothing_saveable),
)
"""Candidates in order of recomputation: ``(name, policy)``; ``None`` checkpoints nothing."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """What level 3 chose.

    Attributes:
      policy: the name of the chosen candidate (see :data:`POLICIES`).
      budget: the budget asked (bytes).
      temp_bytes: compiled temp bytes of each candidate measured, by name.
      scans: how many scans were checkpointed.
    """

    policy: str
    budget: int
    temp_bytes: dict
    scans: int


def _with_policy(jaxpr: jcore.Jaxpr, policy) -> tuple[jcore.Jaxpr, tuple, int]:
    """``jaxpr`` with every top-level scan body checkpointed under ``policy``."""
    steps = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            body = eqn.params["jaxpr"]
            f = jax.checkpoint(jcore.jaxpr_as_fun(body), policy=policy, prevent_cse=False)
            params = {**eqn.params, "jaxpr": J.trace(f, [v.aval for v in body.jaxpr.invars])}
            steps.append(R.Bind(eqn, params))
        else:
            steps.append(R.Bind(eqn))
    count = sum(s.params is not None for s in steps)
    new, consts = R.retrace(jaxpr, steps) if count else (jaxpr, ())
    return new, consts, count


def _temp_bytes(jaxpr: jcore.Jaxpr, consts: tuple, n_lead: int) -> int:
    """Compiled temp bytes of the gradient of ``jaxpr``'s output w.r.t. its float inputs."""
    f = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(jaxpr, ()))
    avals = [v.aval for v in jaxpr.invars]
    diff = [i for i in range(n_lead, len(avals)) if J.is_float(avals[i].dtype)]

    def grad(*args):
        def scalar(*d):
            full = list(args)
            for i, x in zip(diff, d):
                full[i] = x
            (out,) = f(*full)
            return out

        return jax.grad(scalar, argnums=tuple(range(len(diff))))(*[args[i] for i in diff])

    compiled = jax.jit(grad).lower(*map(J.sds, avals)).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def fit(jaxpr: jcore.Jaxpr, consts: tuple, budget: int, *, fn: str):
    """The cheapest candidate of :data:`POLICIES` whose gradient fits ``budget`` bytes.

    ``jaxpr``'s leading ``len(consts)`` inputs are ``consts``. Returns the new jaxpr, its
    constants and the :class:`Choice`.

    Raises:
      ValueError: if the output is not a scalar float, or no candidate fits (the message
        gives the least compiled figure).
    """
    outs = jaxpr.outvars
    if len(outs) != 1 or outs[0].aval.shape != () or not J.is_float(outs[0].aval.dtype):
        got = ", ".join(str(v.aval) for v in outs)
        raise ValueError(
            f"{fn}: level 3 plans the gradient of a scalar loss; fun must return one float "
            f"scalar, got ({got})"
        )
    measured = {}
    for name, policy in POLICIES:
        if policy is None:
            new, new_consts, scans = jaxpr, (), 0
        else:
            new, new_consts, scans = _with_policy(jaxpr, policy)
            if scans == 0:
                break  # no scanned layers: nothing else to try
        lead = len(new_consts) + len(consts)
        measured[name] = _temp_bytes(new, (*new_consts, *consts), lead)
        if measured[name] <= budget:
            return new, (*new_consts, *consts), Choice(name, budget, measured, scans)
    least = min(measured.values())
    hint = "" if len(measured) > 1 else " (fun has no lax.scan layers to checkpoint)"
    raise ValueError(
        f"{fn}: memory_budget={budget} bytes is below the least feasible, {least} bytes of "
        f"compiled temp memory for the gradient{hint}; measured: {measured}"
    )
