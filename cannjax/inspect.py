"""What a backward keeps: residual tables and compiled memory figures.

Example:
  >>> import jax.numpy as jnp, cannjax
  >>> report = cannjax.inspect.residuals(lambda x: cannjax.ops.exp(x).sum(), jnp.ones(4))
  >>> report.count, report.total_bytes
  (1, 16)
  >>> report.rows[0].op
  'exp'
"""

from __future__ import annotations

import dataclasses
import html
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src.ad_checkpoint import saved_residuals as _saved_residuals

__all__ = ["MemoryReport", "Residual", "ResidualReport", "compiled_memory", "memory", "residuals"]

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


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def _html(headers: Sequence[str], rows: Sequence[Sequence[str]], caption: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows
    )
    return f"<table><caption>{html.escape(caption)}</caption><tr>{head}</tr>{body}</table>"


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
        rows = [(str(r.shape), r.dtype, f"{r.nbytes:,}", r.op or "-", r.source) for r in self.rows]
        return headers, rows

    def __str__(self) -> str:
        headers, rows = self._cells()
        total = f"{self.count} residuals, {self.total_bytes:,} bytes"
        return _table(headers, rows) + "\n" + total

    def _repr_html_(self) -> str:
        headers, rows = self._cells()
        return _html(headers, rows, f"{self.count} residuals, {self.total_bytes:,} bytes")


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
        mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
        return ["temp", "arguments", "outputs", "aliased"], [
            (
                mib(self.temp_bytes),
                mib(self.argument_bytes),
                mib(self.output_bytes),
                mib(self.alias_bytes),
            )
        ]

    def __str__(self) -> str:
        return _table(*self._cells())

    def _repr_html_(self) -> str:
        return _html(*self._cells(), "compiled memory")


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
