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
"""

from __future__ import annotations

import html
import math
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np


def render(headers: Sequence[Any], rows: Sequence[Sequence[Any]], *, grid: bool = False) -> str:
    """A plain-text table: the headers, a rule of dashes, one line per row.

    Every cell is ``str``-ed and left-aligned in a column as wide as its widest cell.

    Args:
      headers: the column titles.
      rows: the cells, one sequence per row, as many as there are headers.
      grid: separate the columns by ``" | "`` (the rule crossing them with ``"-+-"``)
        instead of two spaces.

    Returns:
      The table, lines joined by newlines (no trailing newline).
    """
    cells = [[str(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    sep, cross = (" | ", "-+-") if grid else ("  ", "  ")

    def line(r: Sequence[str]) -> str:
        return sep.join(c.ljust(w) for c, w in zip(r, widths))

    rule = cross.join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *map(line, cells[1:])])


def render_html(
    headers: Sequence[Any],
    rows: Sequence[Sequence[Any]],
    caption: str,
    *,
    marked: Collection[int] = (),
) -> str:
    """An HTML table with a caption; the rows whose index is in ``marked`` shaded red.

    Args:
      headers: the column titles.
      rows: the cells, one sequence per row.
      caption: the line above the table (a total, the step...).
      marked: indices of the rows to draw attention to (a non-finite leaf, a flag).

    Returns:
      ``<table>...</table>``, every cell HTML-escaped.
    """
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = []
    for i, r in enumerate(rows):
        style = ' style="background:#fdd"' if i in marked else ""
        tds = "".join(f"<td>{html.escape(str(c))}</td>" for c in r)
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
