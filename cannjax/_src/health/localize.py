"""NaN localization: :func:`find_nonfinite`, an interpreter of the program's jaxpr.

It names the first operator whose forward value or backward cotangent becomes NaN/Inf (a
cannjax op by name, otherwise the JAX primitive), with its source line. The program is
walked with the shared jaxpr walker (:func:`cannjax._src.core.jaxpr.walk`), which steps
into nested calls; the result renders as a text table (``str``) and as HTML in Jupyter
(``_repr_html_``).
"""

from __future__ import annotations

import dataclasses
import html
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import source_info_util

from cannjax._src.core import jaxpr as J
from cannjax._src.core.tables import number, render, render_html, short_source

_FN = "cannjax.health.find_nonfinite"


@dataclasses.dataclass(frozen=True)
class NonFiniteReport:
    """Where a NaN/Inf first appears (see :func:`find_nonfinite`).

    Attributes:
      found: whether any non-finite value appeared.
      stage: ``"input"`` (an argument already non-finite), ``"forward"`` (an operator's
        output) or ``"backward"`` (an operator's input cotangent), or None.
      op: the cannjax operator name (``cannjax.<name>``) or the JAX primitive name.
      primitive: the JAX primitive (``cannjax_op``, ``cannjax_lin``, ``log``, ...).
      source: ``path:line (function)`` of the user code that created the operator
        (``str``, ``repr`` and the HTML table show the file name without its folders).
      name_stack: JAX's name stack of the operator (``jit(f)/...``).
      index: position of the operator in evaluation order (flattened through nested jits).
      inputs: one summary string per input: shape, dtype and finite / NaN / Inf counts.
      outputs: the same for the non-finite values (outputs, or input cotangents).
      operators: how many operators were evaluated.
    """

    found: bool
    stage: str | None = None
    op: str | None = None
    primitive: str | None = None
    source: str | None = None
    name_stack: str | None = None
    index: int | None = None
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    operators: int = 0

    def __str__(self) -> str:
        if not self.found:
            return (
                "no NaN/Inf in the forward values or backward cotangents "
                f"({self.operators} operators)"
            )
        return render(["first non-finite", ""], self._rows(), grid=True)

    def __repr__(self) -> str:
        """The table ``print`` shows: a REPL shows the report, not its fields."""
        return str(self)

    def _rows(self) -> list[list[str]]:
        rows = [
            ["stage", self.stage],
            ["operator", self.op],
            ["primitive", self.primitive],
            ["source", short_source(self.source or "")],
            ["name stack", self.name_stack or ""],
            ["position", f"{self.index} of {self.operators}"],
        ]
        rows += [[f"input {i}", s] for i, s in enumerate(self.inputs)]
        what = "cotangent" if self.stage == "backward" else "output"
        rows += [[f"non-finite {what}", s] for s in self.outputs]
        return [[k, str(v)] for k, v in rows]

    def _repr_html_(self) -> str:
        if not self.found:
            return f"<p>{html.escape(str(self))}</p>"
        rows = self._rows()
        return render_html(["first non-finite", ""], rows, "NaN/Inf localization", marked={0, 1})


def find_nonfinite(fun: Callable, *args: Any, argnums: int | Sequence[int] = 0) -> NonFiniteReport:
    """Names the first operator whose forward value or backward cotangent is NaN/Inf.

    ``fun(*args)`` is traced to a jaxpr, nested ``jit`` / ``checkpoint`` calls are inlined,
    and the operators are evaluated one by one: forward in program order (first output
    that becomes non-finite from finite inputs), then, if the forward is clean, backward
    in reverse order, each operator's VJP applied to its output cotangent (seeded with 1
    for every output of ``fun``; first input cotangent that becomes non-finite from finite
    output cotangents). cannjax operators run their hand-written backward; ``custom_jvp``
    / ``custom_vjp`` functions are kept whole, with their own rules.

    Runs eagerly, operator by operator: meant for debugging a step that produced a NaN,
    not for the training loop. Collectives (code under ``shard_map``) are not supported.

    Args:
      fun: the loss function.
      *args: its arguments (the values that produced the NaN).
      argnums: the arguments differentiated (as in ``jax.grad``); the backward follows
        only cotangents that flow to them.

    Returns:
      A :class:`NonFiniteReport` (``found=False`` if everything stays finite).

    Raises:
      TypeError: ``fun`` is not callable.
      ValueError: an entry of ``argnums`` is out of range for ``args``.

    Example:
      >>> import jax.numpy as jnp
      >>> from cannjax.health import find_nonfinite
      >>> def loss(x):
      ...     return jnp.sum(jnp.sqrt(x) * 0.0)   # d sqrt at 0 is inf; inf * 0 = nan
      >>> r = find_nonfinite(loss, jnp.array([0.0, 1.0]))
      >>> r.stage, r.op
      ('backward', 'sqrt')
    """
    if not callable(fun):
        raise TypeError(f"{_FN}: fun must be callable, got {type(fun).__name__}")
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for a in nums:
        if not isinstance(a, int) or not -len(args) <= a < len(args):
            raise ValueError(f"{_FN}: argnums {argnums!r} out of range for {len(args)} arguments")
    closed = jax.make_jaxpr(fun)(*args)
    tape = _Tape()
    arg_slots = []
    for k, a in enumerate(args):
        for leaf in jax.tree.leaves(a):
            arg_slots.append(tape.lift(leaf))
            if k in {n % len(args) for n in nums}:
                tape.active.add(arg_slots[-1])
    for i, s in enumerate(arg_slots):
        if not _is_finite(tape.values[s]):
            return NonFiniteReport(
                True, "input", f"argument leaf {i}", None, None, None, None,
                (), (_summary(tape.values[s]),), 0,
            )  # fmt: skip
    try:
        out_slots = J.walk(
            closed.jaxpr,
            closed.consts,
            arg_slots,
            tape.forward,
            inline=J.is_call,
            literal=lambda val: ("lit", val),
            lift=tape.lift,
        )
    except _Found as e:
        return dataclasses.replace(e.report, operators=len(tape.steps))
    return tape.backward(out_slots)


class _Found(Exception):
    """Stops the walk at the first new NaN/Inf (a signal, not an error)."""

    def __init__(self, report: NonFiniteReport):
        super().__init__(report.op)
        self.report = report


class _Step(NamedTuple):
    eqn: Any
    ins: list  # slot ids, or ("lit", value)
    outs: list  # slot ids
    where: str  # name stack of the enclosing calls


class _Tape:
    """Every value of the forward pass in a numbered slot, and the equations in order."""

    def __init__(self):
        self.values: list[Any] = []
        self.steps: list[_Step] = []
        self.active: set[int] = set()  # slots that depend on the differentiated arguments

    def push(self, value: Any) -> int:
        self.values.append(value)
        return len(self.values) - 1

    def lift(self, value: Any) -> int:
        """The slot of a concrete value: an argument, a constant or a literal."""
        return self.push(jnp.asarray(value))

    def forward(self, eqn, ins: list, where: str) -> list[int]:
        """Evaluates one equation (``J.walk``'s visit); raises _Found on a new NaN/Inf."""
        invals = [self.values[s] if isinstance(s, int) else s[1] for s in ins]
        outvals = J.bind_eqn(eqn, invals)
        outs = [self.push(o) for o in outvals]
        self.steps.append(_Step(eqn, ins, outs, where))
        if any(isinstance(s, int) and s in self.active for s in ins):
            self.active.update(outs)
        bad = [o for o in outvals if not _is_finite(o)]
        if bad and all(_is_finite(x) for x in invals):
            raise _Found(_report("forward", eqn, len(self.steps) - 1, invals, bad, 0, where))
        return outs

    def backward(self, out_slots: list) -> NonFiniteReport:
        """Runs the recorded equations' VJPs in reverse, the cotangent of every output 1."""
        values, steps = self.values, self.steps
        cts: dict[int, Any] = {}
        for s in out_slots:
            if isinstance(s, int) and _is_float(values[s]):
                cts[s] = _add(cts.get(s), jnp.ones_like(values[s]))
        for idx in range(len(steps) - 1, -1, -1):
            t = steps[idx]
            if not any(s in cts for s in t.outs):
                continue
            invals = [values[s] if isinstance(s, int) else s[1] for s in t.ins]
            fidx = [
                i
                for i, v in enumerate(invals)
                if _is_float(v) and isinstance(t.ins[i], int) and t.ins[i] in self.active
            ]
            if not fidx:
                continue
            outs_ct = [
                cts.get(s, jnp.zeros_like(values[s]))
                if _is_float(values[s])
                else np.zeros(np.shape(values[s]), jax.dtypes.float0)
                for s in t.outs
            ]

            def f(*fx, t=t, invals=invals, fidx=fidx):
                vals = list(invals)
                for i, x in zip(fidx, fx):
                    vals[i] = x
                return J.bind_eqn(t.eqn, vals)

            _, vjp = jax.vjp(f, *[invals[i] for i in fidx])
            in_cts = vjp(outs_ct)
            bad = [c for c in in_cts if not _is_finite(c)]
            if bad:
                return _report("backward", t.eqn, idx, invals, bad, len(steps), t.where)
            for i, c in zip(fidx, in_cts):
                s = t.ins[i]
                if isinstance(s, int):
                    cts[s] = _add(cts.get(s), c)
        return NonFiniteReport(False, operators=len(steps))


def _is_float(x) -> bool:
    dt = getattr(x, "dtype", None)
    return dt is not None and jnp.issubdtype(dt, jnp.inexact)


def _is_finite(x) -> bool:
    return not _is_float(x) or bool(jnp.all(jnp.isfinite(x)))


def _add(a, b):
    return b if a is None else a + b


def _summary(x) -> str:
    x = np.asarray(x)
    desc = f"{x.dtype}{list(x.shape)}"
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return desc
    nan, inf = int(np.isnan(x).sum()), int(np.isinf(x).sum())
    fin = x[np.isfinite(x)]
    rng = f" range [{number(fin.min())}, {number(fin.max())}]" if fin.size else ""
    return f"{desc} NaN={nan} Inf={inf}{rng}"


def _op_name(eqn) -> str:
    rule = eqn.params.get("rule")
    if eqn.primitive.name in ("cannjax_op", "cannjax_lin") and rule is not None:
        return f"cannjax.{rule.name}"
    return eqn.primitive.name


# cannjax's own machinery, skipped when looking for the user's line: an operator's
# equation is made inside core/ and ops/ (or a transform) on behalf of the line that
# called it.
_SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL = tuple(
    os.path.join(_SRC, d) + os.sep
    for d in ("core", "ops", "fuse", "remat", "amp", "parallel", "health")
)


def _source(eqn) -> str:
    frames = list(source_info_util.user_frames(eqn.source_info.traceback))
    pick = next((f for f in frames if not f.file_name.startswith(_INTERNAL)), None)
    pick = pick or (frames[0] if frames else None)
    if pick is None:
        return "<unknown>"
    return f"{pick.file_name}:{pick.start_line} ({pick.function_name})"


def _report(stage, eqn, idx, invals, bad, n, where) -> NonFiniteReport:
    return NonFiniteReport(
        found=True,
        stage=stage,
        op=_op_name(eqn),
        primitive=eqn.primitive.name,
        source=_source(eqn),
        name_stack=(where + J.name_prefix(eqn)).rstrip("/"),
        index=idx,
        inputs=tuple(_summary(v) for v in invals),
        outputs=tuple(_summary(b) for b in bad),
        operators=n,
    )
