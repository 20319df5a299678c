"""What a backward keeps: residual tables and compiled memory figures.

Example:
  >>> import jax.numpy as jnp, cannjax
  >>> report = cannjax.inspect.residuals(lambda x: cannjax.ops.exp(x).sum(), jnp.ones(4))
  >>> report.count, report.total_bytes
  (1, 16)
  >>> report.rows[0].op
  'exp'

What ``cannjax.fuse`` made of a function:

  >>> rep = cannjax.inspect.fusion(lambda x: jnp.sin(jnp.exp(x)).sum(), jnp.ones(4))
  >>> [(r.kind, r.what) for r in rep.rows]
  [('fused', 'exp sin'), ('kept', 'reduce_sum')]
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src.ad_checkpoint import saved_residuals as _saved_residuals

from cannjax._src.core.tables import render, render_html, short_source

_NAMED = re.compile(r"named '(cannjax\.([A-Za-z0-9_]+)\.?[^']*)'")


@dataclasses.dataclass(frozen=True)
class Residual:
    """One array the backward keeps.

    Attributes:
      shape: its shape.
      dtype: its dtype name.
      nbytes: its size in bytes.
      source: JAX's description: the argument it is, or the operation and source line
        that made it, or its ``checkpoint_name``.
      op: the cannjax operator that saved it, or None.
    """

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    source: str
    op: str | None


@dataclasses.dataclass(frozen=True)
class ResidualReport:
    """All residuals of a function's backward, with totals."""

    rows: tuple[Residual, ...]

    @property
    def count(self) -> int:
        """Number of residual arrays."""
        return len(self.rows)

    @property
    def total_bytes(self) -> int:
        """Bytes of all residuals together."""
        return sum(r.nbytes for r in self.rows)

    def by_op(self) -> dict[str, int]:
        """Residual bytes per cannjax operator (``"-"`` for everything else)."""
        out: dict[str, int] = {}
        for r in self.rows:
            out[r.op or "-"] = out.get(r.op or "-", 0) + r.nbytes
        return out

    def _cells(self):
        headers = ["shape", "dtype", "bytes", "op", "source"]
        rows = [
            (str(r.shape), r.dtype, f"{r.nbytes:,}", r.op or "-", short_source(r.source))
            for r in self.rows
        ]
        return headers, rows

    def _caption(self) -> str:
        return f"{self.count} residuals, {self.total_bytes:,} bytes"

    def __str__(self) -> str:
        return render(*self._cells(), right=(2,)) + "\n" + self._caption()

    def __repr__(self) -> str:
        """The table ``print`` shows: a REPL shows the report, not its fields."""
        return str(self)

    def _repr_html_(self) -> str:
        return render_html(*self._cells(), self._caption(), right=(2,))


def residuals(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> ResidualReport:
    """Lists what reverse-mode differentiation of ``fun`` at ``args`` keeps.

    Every residual counts, arguments included: the backward holds them alive.
    """
    if not callable(fun):
        raise TypeError(f"cannjax.inspect.residuals: fun must be callable, got {fun!r}")
    rows = []
    for aval, src in _saved_residuals(fun, *args, **kwargs):
        shape = tuple(aval.shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * aval.dtype.itemsize
        m = _NAMED.search(src)
        rows.append(Residual(shape, aval.dtype.name, nbytes, src, m.group(2) if m else None))
    return ResidualReport(tuple(rows))


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Compiled memory of a program, from XLA's ``memory_analysis()``, in bytes."""

    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int

    def _cells(self):
        rows = [
            ("temp", self.temp_bytes, "XLA's scratch buffers (activations, residuals)"),
            ("arguments", self.argument_bytes, "the program's inputs"),
            ("outputs", self.output_bytes, "its results"),
            ("aliased", self.alias_bytes, "outputs written into donated inputs"),
        ]
        cells = [(name, f"{b:,}", f"{b / 2**20:.2f}", what) for name, b, what in rows]
        return ["memory", "bytes", "MiB", "what"], cells

    def __str__(self) -> str:
        return render(*self._cells(), right=(1, 2))

    def __repr__(self) -> str:
        """The table ``print`` shows: a REPL shows the report, not its fields."""
        return str(self)

    def _repr_html_(self) -> str:
        return render_html(*self._cells(), "compiled memory", right=(1, 2))


def compiled_memory(fn: Callable[..., Any], *args: Any) -> MemoryReport:
    """Memory figures of ``jax.jit(fn)`` compiled for ``args``."""
    m = jax.jit(fn).lower(*args).compile().memory_analysis()
    return MemoryReport(
        int(m.temp_size_in_bytes),
        int(m.argument_size_in_bytes),
        int(m.output_size_in_bytes),
        int(m.alias_size_in_bytes),
    )


def memory(fun: Callable[..., Any], *args: Any, argnums: int | Sequence[int] = 0) -> MemoryReport:
    """Compiled memory of ``jax.jit(jax.grad(fun, argnums))`` at ``args``."""
    if not callable(fun):
        raise TypeError(f"cannjax.inspect.memory: fun must be callable, got {fun!r}")
    return compiled_memory(jax.grad(fun, argnums=argnums), *args)


# ------------------------------------------------------------------------------ fusion
@dataclasses.dataclass(frozen=True)
class FusionRow:
    """One fused cluster, or one equation ``cannjax.fuse`` left as it is.

    Attributes:
      where: ``"top"``, or the body it sits in (``"scan body"``, ``"scan body/remat2
        body"``...).
      kind: ``"fused"`` or ``"kept"``.
      what: the primitives of the cluster (in program order), or the kept primitive.
      line: the user source line(s).
      saved: for a fused cluster, what its operator keeps (``"d f32[256,1024]
        (derivative)"``, ``"x0 f32[...]"``, ``"nothing"``); empty for kept equations.
      saved_bytes: bytes kept per call of the fused operator (0 for kept rows).
      reason: why an equation was kept; the operator name for a fused cluster.
    """

    where: str
    kind: str
    what: str
    line: str
    saved: str
    saved_bytes: int
    reason: str


@dataclasses.dataclass(frozen=True)
class FusionReport:
    """What ``cannjax.fuse`` does to a function at given arguments.

    Attributes:
      rows: one :class:`FusionRow` per fused cluster and per kept equation.
      note: empty, or why nothing was fused (e.g. tracing needs concrete values).
    """

    rows: tuple[FusionRow, ...]
    note: str = ""

    @property
    def fused(self) -> tuple[FusionRow, ...]:
        """The fused clusters."""
        return tuple(r for r in self.rows if r.kind == "fused")

    @property
    def kept(self) -> tuple[FusionRow, ...]:
        """The equations left as they are."""
        return tuple(r for r in self.rows if r.kind == "kept")

    def _cells(self):
        headers = ["where", "kind", "what", "saved", "line", "reason"]
        rows = [
            (r.where, r.kind, r.what, r.saved, _short_lines(r.line), r.reason) for r in self.rows
        ]
        return headers, rows

    def _caption(self) -> str:
        text = f"{len(self.fused)} fused clusters, {len(self.kept)} equations kept"
        return text + (f"; {self.note}" if self.note else "")

    def __str__(self) -> str:
        return render(*self._cells()) + "\n" + self._caption()

    def __repr__(self) -> str:
        """The table ``print`` shows: a REPL shows the report, not its fields."""
        return str(self)

    def _repr_html_(self) -> str:
        return render_html(*self._cells(), self._caption())


def _short_lines(lines: str) -> str:
    """``"; "``-joined source lines, each cut to ``file.py:line``, repeats dropped."""
    return "; ".join(dict.fromkeys(short_source(x) for x in lines.split("; ")))


def _aval_str(aval) -> str:
    return f"{np.dtype(aval.dtype).name}{list(aval.shape)}".replace(" ", "")


def _plan_rows(plan, where: str) -> list[FusionRow]:
    rows = []
    for item in plan.items:
        if hasattr(item, "primitives"):  # a fused cluster
            if not item.saved:
                saved = "nothing"
            elif item.style == "derivative":
                saved = f"d {_aval_str(item.saved[0])} (derivative)"
            else:
                saved = ", ".join(_aval_str(a) for a in item.saved) + " (inputs)"
            what, line = " ".join(item.primitives), "; ".join(item.lines)
            rows.append(
                FusionRow(where, "fused", what, line, saved, item.saved_bytes, item.op_name)
            )
            continue
        rows.append(FusionRow(where, "kept", item.primitive, item.line, "", 0, item.reason))
        if item.body is not None:
            name = f"{item.primitive} body"
            rows.extend(_plan_rows(item.body, name if where == "top" else f"{where}/{name}"))
    return rows


def fusion(
    fun: Callable[..., Any],
    *args: Any,
    level: str = "derivative",
    min_ops: int = 2,
    **kwargs: Any,
) -> FusionReport:
    """Reports what ``cannjax.fuse(fun, level=level, min_ops=min_ops)`` fuses at ``args``.

    ``fun`` may already be a fused function (its own options are then used). One row per
    fused cluster (its primitives, source lines and what its operator keeps) and per
    equation left as it is (with the reason: a matmul, a reduction, ``cond``...);
    ``lax.scan`` and ``jax.checkpoint`` bodies are listed after their equation.
    """
    from cannjax._src.fuse.transform import fuse  # noqa: PLC0415 -- same floor, imported late

    if not callable(fun):
        raise TypeError(f"cannjax.inspect.fusion: fun must be callable, got {fun!r}")
    fused = fun if hasattr(fun, "fusion_plan") else fuse(fun, level=level, min_ops=min_ops)
    plan, note = fused.fusion_plan(*args, **kwargs)
    rows = () if plan is None else tuple(_plan_rows(plan, "top"))
    return FusionReport(rows, note)


# ------------------------------------------------------------------------------ optimize
@dataclasses.dataclass(frozen=True)
class OptimizeRow:
    """One idiom ``cannjax.optimize`` replaced, or one equation it left alone.

    Attributes:
      kind: ``"attention"``, ``"norm"``, ``"gated"`` (a gated MLP: three projections
        and an activation), ``"rope"``, ``"dense"``, ``"activation"``, ``"softmax"``,
        ``"loss"`` for a replacement; ``"left"`` for an equation left alone.
      op: the cannjax operator it became (for ``"left"``: the equation's primitive).
      source: the code it was found as (``"flax.nnx"``, ``"jax.nn.gelu"``; an
        activation or norm read only by dense layers or gated MLPs in a loop body, or an
        activation read only by dense layers elsewhere, adds ``"recomputed in the
        backward"``: each pair saves the producer's input only,
        ``cannjax/_src/optimization/recompute.py``); for ``"left"``: the reason it was
        left alone.
      line: the user source line.
      runs: how often it runs per call: the product of the lengths of the ``lax.scan``
        loops around it (a scanned model's layers), 1 outside any.
    """

    kind: str
    op: str
    source: str
    line: str
    runs: int = 1


class OptimizeReport:
    """What ``cannjax.optimize`` does to a function, and what it saves.

    Attributes:
      level: the level reported.
      rows: the replacements, then the equations left alone.
      remat: at level 3, the checkpointing chosen (else None).
      placed_loops: how many top-level scans (layer loops) have their carries placed as
        their initial values under a sharded program (``docs/parallel.md``).
      unrolled_loops: how many top-level scans computing in half precision run unrolled
        (on a platform that writes stacked half arrays through float32: ``docs/amp.md``).
      residual_bytes: bytes of the residuals of the gradient, ``(before, after)``.
      temp_bytes: compiled temp bytes of the gradient, ``(before, after)``.

    The two memory figures are measured when first read (they compile the gradient
    twice); the rows and :meth:`counts` cost nothing more.
    """

    def __init__(
        self,
        level: int,
        rows: tuple,
        figures: Callable[[], tuple],
        remat=None,
        placed_loops=0,
        unrolled_loops=0,
    ):
        self.level, self.rows, self.remat = level, tuple(rows), remat
        self.placed_loops, self.unrolled_loops = placed_loops, unrolled_loops
        self._figures = figures

    @functools.cached_property
    def _measured(self) -> tuple[tuple[int, int], tuple[int, int]]:
        return self._figures()

    @property
    def residual_bytes(self) -> tuple[int, int]:
        """Bytes of the residuals of the gradient, ``(before, after)``."""
        return self._measured[0]

    @property
    def temp_bytes(self) -> tuple[int, int]:
        """Compiled temp bytes of the gradient, ``(before, after)``."""
        return self._measured[1]

    @property
    def replaced(self) -> tuple[OptimizeRow, ...]:
        """The replacements, in program order."""
        return tuple(r for r in self.rows if r.kind != "left")

    @property
    def left(self) -> tuple[OptimizeRow, ...]:
        """The equations left alone, each with its reason in ``source``."""
        return tuple(r for r in self.rows if r.kind == "left")

    def counts(self) -> dict[str, int]:
        """Number of replacements per kind (``{"attention": 4, "norm": 9, ...}``)."""
        out: dict[str, int] = {}
        for r in self.replaced:
            out[r.kind] = out.get(r.kind, 0) + 1
        return out

    def _cells(self):
        headers = ["kind", "op", "found as / reason", "line"]
        return headers, [(r.kind, r.op, r.source, short_source(r.line)) for r in self.rows]

    def _caption(self) -> str:
        (rb, ra), (tb, ta) = self.residual_bytes, self.temp_bytes
        counts = ", ".join(f"{n} {k}" for k, n in self.counts().items()) or "nothing"
        text = (
            f"level {self.level}: replaced {counts}; left {len(self.left)}. Residuals "
            f"{rb / 2**20:.2f} -> {ra / 2**20:.2f} MiB, compiled temp {tb / 2**20:.2f} -> "
            f"{ta / 2**20:.2f} MiB"
        )
        if self.placed_loops:
            text += f"; carries of {self.placed_loops} loop(s) placed as their inputs"
        if self.unrolled_loops:
            text += f"; {self.unrolled_loops} half-precision loop(s) unrolled"
        if self.remat is not None:
            text += f"; remat: {self.remat.policy}"
        return text

    def __str__(self) -> str:
        return render(*self._cells()) + "\n" + self._caption()

    def __repr__(self) -> str:
        """The table ``print`` shows: a REPL shows the report, not its fields."""
        return str(self)

    def _repr_html_(self) -> str:
        left = range(len(self.replaced), len(self.rows))
        return render_html(*self._cells(), self._caption(), marked=left)


def optimize(
    fun: Callable[..., Any], *args: Any, level: int = 2, memory_budget: int | None = None
) -> OptimizeReport:
    """Reports what ``cannjax.optimize(fun, level=level)`` does at ``args``.

    One row per replacement (the kind, the cannjax operator, the code it was found as and
    the user's source line) and per equation left alone that looked like part of an idiom,
    with the reason. Also the residual bytes and compiled temp bytes of the gradient of
    ``fun``'s output (summed to a scalar) with respect to every argument whose leaves are
    all floating, before and after. ``fun`` may already be optimized (its options are
    then used).

    Example:
      >>> import jax, jax.numpy as jnp, cannjax
      >>> loss = lambda w, x: jnp.mean(jax.nn.gelu(x @ w))
      >>> report = cannjax.inspect.optimize(loss, jnp.ones((4, 3)), jnp.ones((2, 4)))
      >>> report.counts()
      {'dense': 1, 'activation': 1}
    """
    from cannjax._src.optimization.transform import optimize as _optimize  # noqa: PLC0415

    if not callable(fun):
        raise TypeError(f"cannjax.inspect.optimize: fun must be callable, got {fun!r}")
    if hasattr(fun, "optimize_entry"):
        opt, plain = fun, getattr(fun, "__wrapped__", fun)
        level, memory_budget = fun.optimize_options["level"], fun.optimize_options["memory_budget"]
    else:
        opt, plain = _optimize(fun, level=level, memory_budget=memory_budget), fun
    rows = []
    remat = None
    placed = unrolled = 0
    if level > 0:
        e = opt.optimize_entry(*args)
        remat, placed, unrolled = e.remat, e.placed_loops, e.unrolled_loops
        if e.substitution is not None:
            for r, runs in e.substitution.counted_replacements():
                source = f"{r.source}, recomputed in the backward" if r.recomputed else r.source
                rows.append(OptimizeRow(str(r.kind), r.op, source, r.line, runs))
            for x in e.substitution.all_left():
                rows.append(OptimizeRow("left", x.primitive, x.reason, x.line))
    # Differentiate every floating array leaf; other leaves (Python numbers, equinox's
    # static fields) stay fixed, as optimize treats them.
    leaves, tree = jax.tree_util.tree_flatten(args)
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray, np.generic))]
    dyn = [leaves[i] for i in arrays]
    # jnp's issubdtype: numpy's does not count bfloat16 (ml_dtypes) as inexact.
    argnums = tuple(k for k, x in enumerate(dyn) if jax.numpy.issubdtype(x.dtype, np.inexact))

    def scalar(f):
        def s(*d):
            full = list(leaves)
            for i, x in zip(arrays, d):
                full[i] = x
            outs = jax.tree_util.tree_leaves(f(*jax.tree_util.tree_unflatten(tree, full)))
            floats = [o for o in outs if jax.numpy.issubdtype(o.dtype, np.inexact)]
            # A half loss summed in float32 (a bfloat16 sum of many terms rounds).
            return sum(
                jax.numpy.sum(o.astype(jax.numpy.promote_types(o.dtype, np.float32)))
                for o in floats
            )

        return s

    def figures(f):
        res = sum(
            int(np.prod(a.shape, dtype=np.int64)) * a.dtype.itemsize
            for a, _ in _saved_residuals(scalar(f), *dyn)
        )
        temp = memory(scalar(f), *dyn, argnums=argnums).temp_bytes if argnums else 0
        return res, temp

    def measured():
        (rb, tb), (ra, ta) = figures(plain), figures(opt)
        return (rb, ra), (tb, ta)

    return OptimizeReport(level, tuple(rows), measured, remat, placed, unrolled)
