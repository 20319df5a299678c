"""Gradient health: per-leaf statistics, a training-loop monitor, NaN localization.

* :func:`grad_stats` computes, inside ``jit``, for every gradient leaf (named by its pytree
  path) the L2 norm, ``max |g|``, the fraction of exact zeros, the NaN and Inf counts, and
  the global norm ``sqrt(sum_leaves ||g||^2)``. The result is a small pytree
  (:class:`GradStats`: five ``[L]`` vectors and a scalar, ``L`` leaves), so it leaves the
  device in one transfer.
* :class:`GradMonitor` keeps a host-side history every ``every`` steps and flags
  vanishing (``norm < vanishing``), exploding (``norm > exploding``) and non-finite leaves.
* :func:`find_nonfinite` names the first operator whose forward value or backward
  cotangent becomes NaN/Inf (a cannjax op by name, otherwise the JAX primitive and its
  source line).

Each result renders as a text table (``str``), as HTML in Jupyter (``_repr_html_``);
the monitor also plots its history with matplotlib.
"""

from __future__ import annotations

import dataclasses
import html
import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "GradMonitor",
    "GradStats",
    "HealthFlag",
    "NonFiniteReport",
    "find_nonfinite",
    "grad_stats",
]

_FN = "cannjax.health"


# ---------------------------------------------------------------- statistics
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GradStats:
    """Per-leaf gradient statistics (a pytree; every array field survives ``jit``).

    Attributes:
      norm: ``[L]`` float32, L2 norm of each leaf (accumulated in float32).
      max_abs: ``[L]`` float32, ``max |g|`` of each leaf (NaN if the leaf has a NaN).
      zero_frac: ``[L]`` float32, fraction of entries exactly 0.
      nan_count: ``[L]`` int32, number of NaN entries.
      inf_count: ``[L]`` int32, number of +-Inf entries.
      global_norm: ``[]`` float32, ``sqrt(sum(norm**2))``.
      paths: static: the pytree path of each leaf (``jax.tree_util.keystr``).
    """

    norm: jax.Array
    max_abs: jax.Array
    zero_frac: jax.Array
    nan_count: jax.Array
    inf_count: jax.Array
    global_norm: jax.Array
    paths: tuple[str, ...] = dataclasses.field(metadata={"static": True})

    @property
    def finite(self) -> bool:
        """Whether no leaf has a NaN or Inf (host side)."""
        return int(np.sum(self.nan_count)) + int(np.sum(self.inf_count)) == 0

    def rows(self) -> list[dict]:
        """One dict per leaf (host side): path, norm, max_abs, zero_frac, nan, inf."""
        cols = [np.asarray(getattr(self, k)) for k in _FIELDS]
        return [
            {"path": p, **{k: c[i].item() for k, c in zip(_FIELDS, cols)}}
            for i, p in enumerate(self.paths)
        ]

    def table(self) -> str:
        """A text table, one row per leaf, then the global norm."""
        rows = [[r["path"], *(_fmt(r[k]) for k in _FIELDS)] for r in self.rows()]
        text = _text_table(["leaf", *_HEADERS], rows)
        return f"{text}\nglobal norm {_fmt(float(self.global_norm))}"

    def __str__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        rows = [[r["path"], *(_fmt(r[k]) for k in _FIELDS)] for r in self.rows()]
        caption = f"gradient statistics, global norm {_fmt(float(self.global_norm))}"
        return _html_table(["leaf", *_HEADERS], rows, caption, bad=_bad_rows(self))


_FIELDS = ("norm", "max_abs", "zero_frac", "nan_count", "inf_count")
_HEADERS = ("norm", "max|g|", "zeros", "NaN", "Inf")


def grad_stats(grads: Any) -> GradStats:
    """Per-leaf gradient statistics and the global norm; traceable (use inside ``jit``).

    For each floating leaf ``g`` (``n`` entries; the first three in one pass, the counts
    only when the sum of squares is not finite)::

        norm      = sqrt(sum(g**2))          (float32 accumulation)
        max_abs   = max |g|
        zero_frac = #{g == 0} / n
        nan_count = #{isnan(g)},  inf_count = #{isinf(g)}
        global    = sqrt(sum over leaves of norm**2)

    Non-floating leaves (integer state, ``float0`` gradients) are skipped. A norm above
    ~1.8e19 overflows float32 to ``inf`` with ``inf_count == 0``: that is an exploding
    gradient, and the monitor flags it so.

    Args:
      grads: a pytree of arrays (gradients, updates, or any parameters).

    Returns:
      A :class:`GradStats` pytree.

    Raises:
      TypeError: ``grads`` has no floating leaf.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from cannjax.health import grad_stats
      >>> s = jax.jit(grad_stats)({"w": jnp.array([3.0, 0.0]), "b": jnp.array([4.0])})
      >>> s.paths, float(s.global_norm), [float(z) for z in s.zero_frac]
      (("['b']", "['w']"), 5.0, [0.0, 0.5])
    """
    leaves = [
        (jax.tree_util.keystr(path) or "<root>", jnp.asarray(x))
        for path, x in jax.tree_util.tree_leaves_with_path(grads)
        if jnp.issubdtype(jnp.result_type(x), jnp.floating)
    ]
    if not leaves:
        raise TypeError(
            f"{_FN}.grad_stats: grads has no floating-point leaf (got the pytree "
            f"{jax.tree.structure(grads)}); pass the gradients, e.g. jax.grad(loss)(params)"
        )
    cols: dict[str, list] = {k: [] for k in _FIELDS}
    sq = []
    for _, g in leaves:
        s, mx, zeros, nan, inf = _leaf_stats(g)
        sq.append(s)
        cols["norm"].append(jnp.sqrt(s))
        cols["max_abs"].append(mx)
        cols["zero_frac"].append(zeros.astype(jnp.float32) / max(g.size, 1))
        cols["nan_count"].append(nan)
        cols["inf_count"].append(inf)
    return GradStats(
        **{k: jnp.stack(v) for k, v in cols.items()},
        global_norm=jnp.sqrt(jnp.sum(jnp.stack(sq))),
        paths=tuple(p for p, _ in leaves),
    )


def _leaf_stats(g: jax.Array) -> tuple[jax.Array, ...]:
    # One variadic reduction gives sum g^2, max |g| and the zero count in one pass. NaN and
    # Inf counts need passes of their own, but a finite sum of squares proves there are
    # none, so they run only when it is not (the rare, interesting case).
    g32 = g.astype(jnp.float32)

    def combine(a, b):
        return a[0] + b[0], jnp.maximum(a[1], b[1]), a[2] + b[2]

    init = (jnp.float32(0), jnp.float32(0), jnp.int32(0))
    ops = (g32 * g32, jnp.abs(g32), (g == 0).astype(jnp.int32))
    sq, mx, zeros = jax.lax.reduce(ops, init, combine, tuple(range(g.ndim)))

    def counts(_):
        return jnp.sum(jnp.isnan(g), dtype=jnp.int32), jnp.sum(jnp.isinf(g), dtype=jnp.int32)

    none = (jnp.int32(0), jnp.int32(0))
    nan, inf = jax.lax.cond(jnp.isfinite(sq), lambda _: none, counts, None)
    return sq, mx, zeros, nan, inf


# ---------------------------------------------------------------- monitor
class HealthFlag(NamedTuple):
    """A problem the monitor found: at ``step``, leaf ``path`` is ``kind`` with ``value``.

    ``kind`` is ``"nonfinite"`` (value: NaN + Inf count), ``"exploding"`` or
    ``"vanishing"`` (value: the norm); ``path`` is ``"<global>"`` for the global norm.
    ``kind`` ``"loss_scale_stuck"`` (path ``"<loss_scale>"``, value: the overflows counted
    at the minimum scale) comes from a loss scale handed to :meth:`GradMonitor.update`.
    """

    step: int
    path: str
    kind: str
    value: float


class _Record(NamedTuple):
    step: int
    stats: dict  # field -> numpy array
    global_norm: float


class GradMonitor:
    """Keeps a host-side gradient-health history and flags problems.

    Compute :func:`grad_stats` inside the jitted step and hand the result to
    :meth:`update` every step: it copies the statistics to the host only when
    ``step % every == 0`` (one small transfer), appends them to :attr:`history` and
    returns the new :class:`HealthFlag` s. A leaf is flagged ``nonfinite`` if it has a
    NaN/Inf, ``exploding`` if its norm (or the global norm) exceeds ``exploding`` (an
    overflowed, infinite norm included), ``vanishing`` if its norm is below ``vanishing``.

    Args:
      every: record every ``every`` steps (``>= 1``).
      vanishing: norm threshold below which a leaf is vanishing (``>= 0``).
      exploding: norm threshold above which a leaf is exploding (``> vanishing``).
      max_history: keep at most this many records (oldest dropped); None keeps all.

    Example:
      >>> import jax.numpy as jnp
      >>> from cannjax.health import GradMonitor, grad_stats
      >>> mon = GradMonitor(every=2, vanishing=1e-6, exploding=1e3)
      >>> for step in range(4):
      ...     flags = mon.update(step, grad_stats({"w": jnp.full(4, 10.0 ** (2 * step))}))
      >>> [r.step for r in mon.history]
      [0, 2]
      >>> [(f.step, f.path, f.kind) for f in mon.flags]
      [(2, "['w']", 'exploding'), (2, '<global>', 'exploding')]
    """

    def __init__(
        self,
        every: int = 10,
        *,
        vanishing: float = 1e-7,
        exploding: float = 1e3,
        max_history: int | None = None,
    ):
        fn = f"{_FN}.GradMonitor"
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"{fn}: every must be an int >= 1, got {every!r}")
        if not (isinstance(vanishing, (int, float)) and vanishing >= 0):
            raise ValueError(f"{fn}: vanishing must be a number >= 0, got {vanishing!r}")
        if not (isinstance(exploding, (int, float)) and exploding > vanishing):
            raise ValueError(
                f"{fn}: exploding must be a number > vanishing ({vanishing}), got {exploding!r}"
            )
        if max_history is not None and (not isinstance(max_history, int) or max_history < 1):
            raise ValueError(f"{fn}: max_history must be None or an int >= 1, got {max_history!r}")
        self.every = every
        self.vanishing = float(vanishing)
        self.exploding = float(exploding)
        self.max_history = max_history
        self.history: list[_Record] = []
        self.flags: list[HealthFlag] = []
        self.paths: tuple[str, ...] = ()

    def should_record(self, step: int) -> bool:
        """Whether :meth:`update` at ``step`` records (``step % every == 0``)."""
        return step % self.every == 0

    def update(self, step: int, stats: GradStats, loss_scale: Any = None) -> list[HealthFlag]:
        """Records ``stats`` at ``step`` if due; returns the flags raised by this record.

        ``loss_scale``: optionally the step's :mod:`cannjax.amp` loss scale. A dynamic
        scale stuck at its minimum (gradients overflow even there) is then flagged
        ``loss_scale_stuck`` here, with the other flags, instead of warned about by
        :func:`cannjax.amp.check_loss_scale`.
        """
        if not isinstance(stats, GradStats):
            raise TypeError(
                f"{_FN}.GradMonitor.update: stats must be a GradStats from "
                f"cannjax.health.grad_stats, got {type(stats).__name__}"
            )
        if not self.should_record(int(step)):
            return []
        if self.paths and stats.paths != self.paths:
            raise ValueError(
                f"{_FN}.GradMonitor.update: the gradient pytree changed: the history has "
                f"leaves {list(self.paths)}, got {list(stats.paths)}; use one monitor per model"
            )
        self.paths = stats.paths
        host = jax.device_get({k: getattr(stats, k) for k in (*_FIELDS, "global_norm")})
        gnorm = float(host.pop("global_norm"))
        self.history.append(_Record(int(step), host, gnorm))
        if self.max_history is not None and len(self.history) > self.max_history:
            del self.history[0]
        new = self._flags(int(step), host, gnorm)
        if loss_scale is not None:
            new += _loss_scale_flags(int(step), loss_scale)
        self.flags.extend(new)
        return new

    def _flags(self, step: int, host: dict, gnorm: float) -> list[HealthFlag]:
        out = []
        for i, path in enumerate(self.paths):
            bad = int(host["nan_count"][i]) + int(host["inf_count"][i])
            norm = float(host["norm"][i])
            if bad:
                out.append(HealthFlag(step, path, "nonfinite", float(bad)))
            elif norm > self.exploding:
                out.append(HealthFlag(step, path, "exploding", norm))
            elif norm < self.vanishing:
                out.append(HealthFlag(step, path, "vanishing", norm))
        # An overflowed (infinite) global norm from finite leaves is an explosion too.
        if gnorm > self.exploding and not any(f.kind == "nonfinite" for f in out):
            out.append(HealthFlag(step, "<global>", "exploding", gnorm))
        return out

    # ------------------------------------------------------------ rendering
    def table(self) -> str:
        """The latest record as a text table, then the flags of that step."""
        if not self.history:
            return "GradMonitor: no record yet"
        rec = self.history[-1]
        rows = [
            [p, *(_fmt(rec.stats[k][i].item()) for k in _FIELDS), self._flag_of(rec.step, p)]
            for i, p in enumerate(self.paths)
        ]
        head = (
            f"step {rec.step}: global norm {_fmt(rec.global_norm)} "
            f"({len(self.history)} records, every {self.every} steps, "
            f"{len(self.flags)} flags)"
        )
        return head + "\n" + _text_table(["leaf", *_HEADERS, "flag"], rows)

    def __str__(self) -> str:
        return self.table()

    def _flag_of(self, step: int, path: str) -> str:
        return ",".join(f.kind for f in self.flags if f.step == step and f.path == path)

    def _repr_html_(self) -> str:
        if not self.history:
            return "<p>GradMonitor: no record yet</p>"
        rec = self.history[-1]
        rows = [
            [p, *(_fmt(rec.stats[k][i].item()) for k in _FIELDS), self._flag_of(rec.step, p)]
            for i, p in enumerate(self.paths)
        ]
        bad = {i for i, r in enumerate(rows) if r[-1]}
        caption = f"step {rec.step}: global norm {_fmt(rec.global_norm)}"
        return _html_table(["leaf", *_HEADERS, "flag"], rows, caption, bad=bad)

    def plot(self, ax: Any = None, *, leaves: bool = True) -> Any:
        """Plots the global norm (and each leaf's norm) against the step, log scale.

        Thresholds are drawn as dashed lines; flagged steps are marked. Returns the axes.
        """
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(7, 4))
        steps = [r.step for r in self.history]
        if leaves:
            for i, p in enumerate(self.paths):
                ax.plot(steps, [r.stats["norm"][i] for r in self.history], lw=0.8, label=p)
        ax.plot(steps, [r.global_norm for r in self.history], "k", lw=2, label="global")
        for y, name in ((self.vanishing, "vanishing"), (self.exploding, "exploding")):
            if y > 0:
                ax.axhline(y, ls="--", c="gray", lw=0.8)
                ax.annotate(name, (steps[0] if steps else 0, y), fontsize=8, color="gray")
        flagged = sorted({f.step for f in self.flags})
        gn = {r.step: r.global_norm for r in self.history}
        ax.plot(flagged, [gn.get(s, np.nan) for s in flagged], "rx", label="flagged")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("gradient L2 norm")
        ax.legend(fontsize=7)
        return ax


def _loss_scale_flags(step: int, loss_scale: Any) -> list[HealthFlag]:
    # Imported here: cannjax.amp imports nothing from health, and health should not
    # pull amp in for users who never scale a loss.
    from cannjax._src.amp.loss_scale import LossScaleWarning, check_loss_scale

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LossScaleWarning)
        try:
            report = check_loss_scale(loss_scale)
        except TypeError as e:
            raise TypeError(
                f"{_FN}.GradMonitor.update: loss_scale must be a cannjax.amp loss scale, "
                f"got {type(loss_scale).__name__}"
            ) from e
    if not report["stuck"]:
        return []
    return [HealthFlag(step, "<loss_scale>", "loss_scale_stuck", report["min_scale_overflows"])]


# ---------------------------------------------------------------- NaN localization
@dataclasses.dataclass(frozen=True)
class NonFiniteReport:
    """Where a NaN/Inf first appears (see :func:`find_nonfinite`).

    Attributes:
      found: whether any non-finite value appeared.
      stage: ``"input"`` (an argument already non-finite), ``"forward"`` (an operator's
        output) or ``"backward"`` (an operator's input cotangent), or None.
      op: the cannjax operator name (``cannjax.<name>``) or the JAX primitive name.
      primitive: the JAX primitive (``cannjax_op``, ``cannjax_lin``, ``log``, ...).
      source: ``file:line (function)`` of the user code that created the operator.
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
        return _text_table(["first non-finite", ""], self._rows())

    def _rows(self) -> list[list[str]]:
        rows = [
            ["stage", self.stage],
            ["operator", self.op],
            ["primitive", self.primitive],
            ["source", self.source],
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
        return _html_table(["first non-finite", ""], rows, "NaN/Inf localization", bad={0, 1})


_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "remat2": "jaxpr", "checkpoint": "jaxpr"}  # fmt: skip


class _Tape(NamedTuple):
    eqn: Any
    ins: list  # slot ids, or ("lit", value)
    outs: list  # slot ids
    where: str  # name stack of the enclosing calls


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
        raise TypeError(f"{_FN}.find_nonfinite: fun must be callable, got {type(fun).__name__}")
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for a in nums:
        if not isinstance(a, int) or not -len(args) <= a < len(args):
            raise ValueError(
                f"{_FN}.find_nonfinite: argnums {argnums!r} out of range for {len(args)} arguments"
            )
    closed = jax.make_jaxpr(fun)(*args)
    values: list[Any] = []
    tape: list[_Tape] = []
    arg_slots = []
    active: set[int] = set()  # slots that depend on the differentiated arguments
    for k, a in enumerate(args):
        for leaf in jax.tree.leaves(a):
            values.append(jnp.asarray(leaf))
            arg_slots.append(len(values) - 1)
            if k in {n % len(args) for n in nums}:
                active.add(len(values) - 1)
    for i, s in enumerate(arg_slots):
        if not _is_finite(values[s]):
            return NonFiniteReport(
                True, "input", f"argument leaf {i}", None, None, None, None,
                (), (_summary(values[s]),), 0,
            )  # fmt: skip
    found: list[NonFiniteReport] = []
    out_slots = _run(closed.jaxpr, closed.consts, arg_slots, values, tape, found, active)
    if found:
        return dataclasses.replace(found[0], operators=len(tape))
    # Backward: cotangent of every output is 1.
    cts: dict[int, Any] = {}
    for s in out_slots:
        if isinstance(s, int) and _is_float(values[s]):
            cts[s] = _add(cts.get(s), jnp.ones_like(values[s]))
    for idx in range(len(tape) - 1, -1, -1):
        t = tape[idx]
        if not any(s in cts for s in t.outs):
            continue
        invals = [values[s] if isinstance(s, int) else s[1] for s in t.ins]
        fidx = [
            i
            for i, v in enumerate(invals)
            if _is_float(v) and isinstance(t.ins[i], int) and t.ins[i] in active
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
            return _eval(t.eqn, vals)

        _, vjp = jax.vjp(f, *[invals[i] for i in fidx])
        in_cts = vjp(outs_ct)
        bad = [c for c in in_cts if not _is_finite(c)]
        if bad:
            return _report("backward", t.eqn, idx, invals, bad, len(tape), t.where)
        for i, c in zip(fidx, in_cts):
            s = t.ins[i]
            if isinstance(s, int):
                cts[s] = _add(cts.get(s), c)
    return NonFiniteReport(False, operators=len(tape))


def _run(jaxpr, consts, in_slots, values, tape, found, active, where="") -> list:
    env: dict[Any, Any] = {}

    def read(v):
        if type(v).__name__ == "Literal":
            return ("lit", v.val)
        return env[v]

    for v, c in zip(jaxpr.constvars, consts):
        values.append(jnp.asarray(c) if not isinstance(c, jax.Array) else c)
        env[v] = len(values) - 1
    for v, s in zip(jaxpr.invars, in_slots):
        env[v] = s
    for eqn in jaxpr.eqns:
        if found:
            return []
        ins = [read(v) for v in eqn.invars]
        sub = _CALLS.get(eqn.primitive.name)
        if sub is not None and sub in eqn.params:
            inner = eqn.params[sub]
            inner_jaxpr = getattr(inner, "jaxpr", inner)
            inner_consts = getattr(inner, "consts", ())
            slots = [_slot_of(s, values) for s in ins]
            name = eqn.params.get("name", "")
            inner_where = f"{where}{_stack(eqn)}{eqn.primitive.name}({name})/"
            outs = _run(inner_jaxpr, inner_consts, slots, values, tape, found, active, inner_where)
            if found:
                return []
            outs = [_slot_of(s, values) for s in outs]
        else:
            invals = [values[s] if isinstance(s, int) else s[1] for s in ins]
            outvals = _eval(eqn, invals)
            outs = []
            for o in outvals:
                values.append(o)
                outs.append(len(values) - 1)
            tape.append(_Tape(eqn, ins, outs, where))
            if any(isinstance(s, int) and s in active for s in ins):
                active.update(outs)
            bad = [o for o in outvals if not _is_finite(o)]
            if bad and all(_is_finite(x) for x in invals):
                found.append(_report("forward", eqn, len(tape) - 1, invals, bad, 0, where))
                return []
        for v, s in zip(eqn.outvars, outs):
            env[v] = s
    return [read(v) for v in jaxpr.outvars]


def _slot_of(s, values) -> int:
    if isinstance(s, int):
        return s
    values.append(jnp.asarray(s[1]))
    return len(values) - 1


def _eval(eqn, vals) -> list:
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*vals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


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
    rng = f" range [{_fmt(fin.min())}, {_fmt(fin.max())}]" if fin.size else ""
    return f"{desc} NaN={nan} Inf={inf}{rng}"


def _op_name(eqn) -> str:
    rule = eqn.params.get("rule")
    if eqn.primitive.name in ("cannjax_op", "cannjax_lin") and rule is not None:
        return f"cannjax.{rule.name}"
    return eqn.primitive.name


_PKG = os.path.dirname(os.path.abspath(__file__))
_INTERNAL = tuple(os.path.join(_PKG, d) for d in ("core", "ops", "transforms", "health.py"))


def _source(eqn) -> str:
    from jax._src import source_info_util as siu

    frames = list(siu.user_frames(eqn.source_info.traceback))
    pick = next((f for f in frames if not f.file_name.startswith(_INTERNAL)), None)
    pick = pick or (frames[0] if frames else None)
    if pick is None:
        return "<unknown>"
    return f"{pick.file_name}:{pick.start_line} ({pick.function_name})"


def _stack(eqn) -> str:
    s = str(eqn.source_info.name_stack)
    return f"{s}/" if s else ""


def _report(stage, eqn, idx, invals, bad, n, where) -> NonFiniteReport:
    return NonFiniteReport(
        found=True,
        stage=stage,
        op=_op_name(eqn),
        primitive=eqn.primitive.name,
        source=_source(eqn),
        name_stack=(where + _stack(eqn)).rstrip("/"),
        index=idx,
        inputs=tuple(_summary(v) for v in invals),
        outputs=tuple(_summary(b) for b in bad),
        operators=n,
    )


# ---------------------------------------------------------------- rendering helpers
def _fmt(v: Any) -> str:
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    v = float(v)
    if v == 0 or not math.isfinite(v):
        return str(v)
    return f"{v:.3e}" if abs(v) < 1e-3 or abs(v) >= 1e4 else f"{v:.4f}"


def _text_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = " | ".join(str(h).ljust(w) for h, w in zip(header, widths))
    out = [line, "-+-".join("-" * w for w in widths)]
    out += [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def _html_table(header, rows, caption: str, bad=frozenset()) -> str:
    th = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = []
    for i, r in enumerate(rows):
        style = ' style="background:#fdd"' if i in bad else ""
        tds = "".join(f"<td>{html.escape(str(c))}</td>" for c in r)
        body.append(f"<tr{style}>{tds}</tr>")
    return (
        f"<table><caption>{html.escape(caption)}</caption><thead><tr>{th}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table>"
    )


def _bad_rows(stats: GradStats) -> set[int]:
    nan, inf = np.asarray(stats.nan_count), np.asarray(stats.inf_count)
    return {i for i in range(len(stats.paths)) if nan[i] + inf[i] > 0}
