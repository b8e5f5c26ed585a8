"""How the course prints: one table renderer, one way to write a number (sizes through `format.units`), one visible
check.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

from zckpt_nb.format.units import size

__all__ = ["FAILED", "check", "number", "size", "table"]

MAX_COLUMNS = 8  # a wider table does not fit a notebook page: split it, or drop a column
FAILED = "✗ FAILED"  # what a failed check prints; the notebook runner and the tests look for it


def number(value: Any) -> str:
    """A table cell: counts with thousands separators, other figures to 3 significant digits, checks as yes/no."""
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return str(value)


class Table:
    """Rows drawn as a table: HTML in a notebook, aligned text in a terminal."""

    def __init__(self, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
        self.columns = list(columns)
        self.cells = [[number(row.get(c, "")) for c in self.columns] for row in rows]

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{escape(c)}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td>{escape(x)}</td>" for x in line) + "</tr>" for line in self.cells)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def __repr__(self) -> str:
        widths = [max(len(x) for x in col) for col in zip(self.columns, *self.cells)]
        return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip()
                         for line in [self.columns, *self.cells])


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> Table:
    """Draw `rows` (dicts keyed by column name) as a table of at most 8 columns; `columns` picks and orders them."""
    columns = list(columns or dict.fromkeys(key for row in rows for key in row))
    if len(columns) > MAX_COLUMNS:
        raise ValueError(f"a table of {len(columns)} columns is too wide (at most {MAX_COLUMNS}): {columns}")
    return Table(rows, columns)


def check(label: str, condition: object, detail: str = "") -> None:
    """Print one line that says whether `condition` holds: `✓ label`, or `✗ FAILED label` (the runner and the tests
    fail a notebook that prints one), with `detail` after it."""
    print(f"{'✓' if condition else FAILED} {label}" + (f"  ({detail})" if detail else ""))
