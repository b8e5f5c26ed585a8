"""The notebooks form a course: each opens the same way, ends with exercises whose answers are computed, and a summary.

These read the committed notebooks only (no kernel): the runs themselves are in test_notebooks.py.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from zckpt_nb.lessons.notebooks import notebook_paths

pytestmark = pytest.mark.fast
NOTEBOOKS = notebook_paths(Path(__file__).resolve().parents[1] / "notebooks")
IDS = [p.stem for p in NOTEBOOKS]


def headings(nb: nbformat.NotebookNode) -> list[str]:
    """Every Markdown heading line, in order."""
    return [line.strip() for c in nb.cells if c.cell_type == "markdown" for line in c.source.splitlines()
            if line.startswith("#")]


def test_the_course_is_numbered_without_gaps():
    assert [int(p.name[:2]) for p in NOTEBOOKS] == list(range(1, len(NOTEBOOKS) + 1))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_each_notebook_opens_with_its_number_what_you_learn_prerequisites_and_run_time(path):
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0].source
    assert nb.cells[0].cell_type == "markdown" and first.startswith(f"# {path.name[:2]} ·"), first.splitlines()[0]
    for part in ("What you will learn", "Prerequisites", "run time"):
        assert part.lower() in first.lower(), f"{path.name}: the opening cell does not say {part!r}"
    assert sum("parameters" in c.metadata.get("tags", []) for c in nb.cells) == 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_each_notebook_ends_with_exercises_whose_answers_are_collapsed_code_then_a_summary(path):
    nb = nbformat.read(path, as_version=4)
    found = headings(nb)
    assert "## Exercises" in found and "## Summary" in found, found
    assert found.index("## Exercises") < found.index("## Summary")
    answers = [c for c in nb.cells if "answer" in c.metadata.get("tags", [])]
    assert 2 <= len(answers) <= 3, f"{path.name}: {len(answers)} answer cells"
    for cell in answers:
        assert cell.cell_type == "code" and "(" in cell.source, f"{path.name}: an answer must be computed by a call"
        hidden = cell.metadata.get("jupyter", {})
        assert hidden.get("source_hidden") and hidden.get("outputs_hidden"), f"{path.name}: an answer is not collapsed"
