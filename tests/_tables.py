"""Reading back the text tables the reports print (``cannjax._src.core.tables.render``)."""

from __future__ import annotations

import re


def table_cells(text: str) -> list[list[str]]:
    """The cells of a text table, checked to be aligned; the header row first.

    The rule line (dashes under the header) gives each column's span; every line of the
    table must keep its cells inside those spans, with only the separator (spaces, or
    ``" | "`` in a grid) between them, so every row has the same column positions.
    """
    head, rule, *rows = text.splitlines()
    assert re.fullmatch(r"-+((  |-\+-)-+)*", rule), f"not a rule line: {rule!r}"
    spans = [m.span() for m in re.finditer(r"-+", rule)]
    cells = []
    for line in (head, *rows):
        assert len(line) <= spans[-1][1] and line == line.rstrip(), f"ragged: {line!r}"
        gaps = [line[end:start] for (_, end), (start, _) in zip(spans, spans[1:])]
        assert all(not g.strip(" |") for g in gaps), f"a cell crosses a column: {line!r}"
        cells.append([line[start:end].strip() for start, end in spans])
    return cells
