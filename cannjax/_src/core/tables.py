"""The table renderer everyone shares: the ``str`` and ``_repr_html_`` of the reports.

``cannjax.inspect`` and ``cannjax.health`` render their results with these, so a report
reads the same in a terminal and in Jupyter whichever module made it.

Example:
  >>> print(render(["op", "bytes"], [["exp", "4,096"], ["fused_exp_sin", "1,024"]]))
  op             bytes
  -------------  -----
  exp            4,096
  fused_exp_sin  1,024
  >>> print(render(["leaf", "L2 norm"], [["['w']", number(12.5)]], grid=True))
  leaf  | L2 norm
  ------+--------
  ['w'] | 12.5000

Source locations shrink to the file name and line, as a reader looks them up:

  >>> short_source("output of exp from /home/me/proj/model.py:42:17 (block)")
  'output of exp from model.py:42 (block)'
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np


def render(
    headers: Sequence[Any],
    rows: Sequence[Sequence[Any]],
    *,
    grid: bool = False,
    right: Collection[int] = (),
) -> str:
    """A plain-text table: the headers, a rule of dashes, one line per row.

    Every cell is ``str``-ed and placed in a column as wide as its widest cell, so each
    column starts at the same position on every line; lines carry no trailing spaces.

    Args:
      headers: the column titles.
      rows: the cells, one sequence per row, as many as there are headers.
      grid: separate the columns by ``" | "`` (the rule crossing them with ``"-+-"``)
        instead of two spaces.
      right: indices of the columns to right-align (numbers); the others are
        left-aligned.

    Returns:
      The table, lines joined by newlines (no trailing newline).

    Example:
      >>> print(render(["array", "bytes"], [["x", "16"], ["cos(x)", "1,024"]], right=(1,)))
      array   bytes
      ------  -----
      x          16
      cos(x)  1,024
    """
    cells = [[str(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    sep, cross = (" | ", "-+-") if grid else ("  ", "  ")

    def line(r: Sequence[str]) -> str:
        padded = (
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        )
        return sep.join(padded).rstrip()

    rule = cross.join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *map(line, cells[1:])])


def render_html(
    headers: Sequence[Any],
    rows: Sequence[Sequence[Any]],
    caption: str,
    *,
    marked: Collection[int] = (),
    right: Collection[int] = (),
) -> str:
    """An HTML table with a caption; the rows whose index is in ``marked`` shaded red.

    Args:
      headers: the column titles.
      rows: the cells, one sequence per row.
      caption: the line above the table (a total, the step...).
      marked: indices of the rows to draw attention to (a non-finite leaf, a flag).
      right: indices of the columns to right-align (numbers).

    Returns:
      ``<table>...</table>``, every cell HTML-escaped.

    Example:
      >>> table = render_html(["op"], [["a<b"]], "1 row")
      >>> table.startswith("<table><caption>1 row</caption>"), "<td>a&lt;b</td>" in table
      (True, True)
    """

    def td(i: int, c: Any) -> str:
        style = ' style="text-align:right"' if i in right else ""
        return f"<td{style}>{html.escape(str(c))}</td>"

    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = []
    for i, r in enumerate(rows):
        style = ' style="background:#fdd"' if i in marked else ""
        tds = "".join(td(j, c) for j, c in enumerate(r))
        body.append(f"<tr{style}>{tds}</tr>")
    return (
        f"<table><caption>{html.escape(caption)}</caption><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table>"
    )


def number(v: Any) -> str:
    """A number as a table cell: integers whole, floats to 4 decimals or in e-notation.

    Floats below 1e-3 or from 1e4 up in magnitude take ``.3e``; 0, NaN and +-Inf print
    as Python does (``0.0``, ``nan``, ``inf``).

    Example:
      >>> [number(v) for v in (3, 0.5, 12345.0, 2e-5, float("nan"))]
      ['3', '0.5000', '1.234e+04', '2.000e-05', 'nan']
    """
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    v = float(v)
    if v == 0 or not math.isfinite(v):
        return str(v)
    return f"{v:.3e}" if abs(v) < 1e-3 or abs(v) >= 1e4 else f"{v:.4f}"


# A path ending in a Python file, its line, and JAX's optional column: "/a/b/model.py:42:17".
_LOCATION = re.compile(
    r"(?:(?:[A-Za-z]:)?[^\s:;()'\"]*[/\\])?"  # the folders (and a drive letter), dropped
    r"([^\s/\\:;()'\"]+\.pyi?):(\d+)(?::\d+)?"  # the file name, line and column
)
# The enclosing functions of a nested one: "outer.<locals>." in "(outer.<locals>.inner)".
_LOCALS = re.compile(r"[\w.<>]*<locals>\.")


def short_source(text: str) -> str:
    """``text`` with each source location cut to ``file.py:line``.

    JAX describes where an array comes from with the full path, line and column of the
    code (``/home/me/proj/model.py:42:17 (Block.__call__.<locals>.mlp)``); a table shows
    the file name and line (``model.py:42 (mlp)``), enough to find it in an editor.

    Example:
      >>> short_source("named 'cannjax.exp.out' from /x/y/ops.py:7:3 (f.<locals>.g)")
      "named 'cannjax.exp.out' from ops.py:7 (g)"
      >>> short_source("from the argument x")
      'from the argument x'
    """
    return _LOCALS.sub("", _LOCATION.sub(r"\1:\2", text))
