"""Tables for notebooks (HTML) and the shell (text): one number format per column.
"""

from __future__ import annotations

from typing import Any


def cell(v: object) -> str:
    """One table cell as text: numbers with thousands separators, checks as yes/no."""
    if isinstance(v, bool):  # before int: bool is an int subclass, and "1" is not what a check table means
        return "yes" if v else "no"
    if isinstance(v, float):  # never scientific notation for a large figure: 1,238,866.7, not 1.23887e+06
        return f"{v:,.1f}" if abs(v) >= 1e4 else f"{v:.6g}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def table(rows: list[dict[str, object]]) -> object:
    """Render a list of dicts as a Markdown table in the notebook (numbers with thousands separators)."""
    from IPython.display import Markdown

    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(r[k]) for k in head) + " |" for r in rows]
    return Markdown("\n".join(lines))


def html_table(rows: list[dict[str, object]]) -> str:
    """The same table as HTML, for a widget that is updated from a background thread."""
    from html import escape

    head = "".join(f"<th>{escape(k)}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{escape(cell(v))}</td>" for v in r.values()) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def format_table(rows: list[dict[str, Any]]) -> str:
    """Rows of a table as aligned plain text for a terminal (cells formatted as the notebooks' tables)."""
    cells = [[cell(v) for v in r.values()] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(list(rows[0]), *cells)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in [list(rows[0]), *cells])
