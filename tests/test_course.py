"""The notebooks form a course: each opens the same way, ends with exercises whose answers are computed, and a summary.

These read the committed notebooks only (no kernel): the runs themselves are in test_notebooks.py.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from conftest import procs_mentioning

from zckpt_nb.course import runs
from zckpt_nb.course.notebooks import check_parameters, notebook_paths, parameter_names
from zckpt_nb.course.show import FAILED, check, size, table
from zckpt_nb.errors import LaunchError, LaunchTimeout, UsageError

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


def folded_answers(nb: nbformat.NotebookNode) -> int:
    """Answers folded in `<details>` blocks of the exercises' markdown cells, from "## Exercises" to "## Summary"
    (closed until the learner opens one); a fold elsewhere (a section's detail, an appendix) is not an answer."""
    lines = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown").splitlines()
    start = lines.index("## Exercises") if "## Exercises" in lines else len(lines)
    end = next((i for i in range(start, len(lines)) if lines[i] == "## Summary"), len(lines))
    return "\n".join(lines[start:end]).count("<details>")


def markdown_displays(nb: nbformat.NotebookNode) -> int:
    """`Markdown(...)` displays in code cells: sentences a cell computes instead of words the notebook holds."""
    return sum(c.source.count("Markdown(") for c in nb.cells if c.cell_type == "code")


def discarded_tables(nb: nbformat.NotebookNode) -> list[int]:
    """Code cells with a `table(...)` call that is not the cell's last expression: Jupyter shows only the last
    expression's value, so such a table is built and never drawn (it must be passed to `display`)."""
    import ast

    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or "table(" not in cell.source:
            continue
        body = ast.parse("\n".join(line for line in cell.source.splitlines() if not line.startswith(("%", "!")))).body
        if any(isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
               and getattr(node.value.func, "id", None) == "table" for node in body[:-1]):
            found.append(index)
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_table_a_cell_builds_is_drawn(path):
    assert not discarded_tables(nbformat.read(path, as_version=4)), path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_each_notebook_ends_with_exercises_whose_answers_are_folded_then_a_summary(path):
    nb = nbformat.read(path, as_version=4)
    found = headings(nb)
    assert "## Exercises" in found and "## Summary" in found, found
    assert found.index("## Exercises") < found.index("## Summary")
    folded = folded_answers(nb)
    legacy = [c for c in nb.cells if "answer" in c.metadata.get("tags", [])]  # until every notebook folds its answers
    assert 2 <= folded + len(legacy) <= 5 and not (folded and legacy), f"{path.name}: {folded} + {len(legacy)} answers"
    sources = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert sources.count("<details>") == sources.count("</details>") == sources.count("<summary>")
    for cell in legacy:
        hidden = cell.metadata.get("jupyter", {})
        assert hidden.get("source_hidden") and hidden.get("outputs_hidden"), f"{path.name}: an answer is not collapsed"


def test_notebooks_that_fold_their_answers_hold_their_words_in_markdown():
    shown = {p.name: markdown_displays(nbformat.read(p, as_version=4)) for p in NOTEBOOKS
             if folded_answers(nbformat.read(p, as_version=4))}
    assert shown and sum(shown.values()) <= 3, shown

def test_notebook_parameters_are_checked_against_the_parameters_cell():
    path = NOTEBOOKS[0]
    assert {"WORLD_SIZES", "PERSISTENCE_THRESHOLD", "OUTPUT_ROOT"} <= set(parameter_names(path))
    check_parameters(path, {"WORLD_SIZES": [3]})
    with pytest.raises(UsageError, match="takes no parameter NPROC; it takes WORLD_SIZES"):
        check_parameters(path, {"NPROC": 3})


def test_the_runner_refuses_an_unknown_parameter_before_running_anything(tmp_path):
    done = subprocess.run([sys.executable, "-m", "zckpt_nb.course.notebooks", "--only", "01", "--build", str(tmp_path),
                           "-p", "NPROC", "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "takes no parameter NPROC" in done.stderr
    assert not list(tmp_path.iterdir())


def test_the_runner_fails_a_notebook_whose_check_fails_and_its_kernel_prints_no_warning(tmp_path):
    cells = [nbformat.v4.new_code_cell("SIZE = 3", metadata={"tags": ["parameters"]}),
             nbformat.v4.new_code_cell("from zckpt_nb.course.show import check\ncheck('three', SIZE == 3)")]
    nbformat.write(nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}}), tmp_path / "01_probe.ipynb")
    command = [sys.executable, "-m", "zckpt_nb.course.notebooks", "--notebooks", str(tmp_path), "--build",
               str(tmp_path / "build")]
    passed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert passed.returncode == 0 and "01_probe.ipynb" in passed.stdout and " ok" in passed.stdout, passed
    assert "WARNING" not in passed.stderr, passed.stderr  # the kernel talks over IPC: no unencrypted TCP warning
    failed = subprocess.run([*command, "-p", "SIZE", "4"], capture_output=True, text=True, timeout=300)
    assert failed.returncode == 1 and f"{FAILED} three" in failed.stdout, failed.stdout


def test_a_table_is_at_most_eight_columns_and_writes_numbers_one_way():
    rows = [{"rank": 0, "bytes": size(3 * 2**20), "share": 0.123456, "equal": True, "P": 1234567}]
    assert repr(table(rows)).splitlines()[1].split() == ["0", "3.0", "MiB", "0.123", "yes", "1,234,567"]
    assert [size(n) for n in (812, 3 * 2**10, 14.3 * 2**20, 1.25 * 2**30)] == [
        "812 B", "3.0 KiB", "14.3 MiB", "1.25 GiB"]
    with pytest.raises(ValueError, match="at most 8"):
        table([{str(i): i for i in range(9)}])


def test_check_prints_one_line_with_its_verdict(capsys):
    check("equal", 1 == 1, "1 of 1")
    check("equal", 1 == 2)
    assert capsys.readouterr().out.splitlines() == ["✓ equal  (1 of 1)", f"{FAILED} equal"]


def test_a_command_runs_bounded_and_a_failure_says_what_each_rank_said_in_a_few_lines(tmp_path):
    job = runs.run("python -c 'print(1); print(2)'", timeout=60, log=tmp_path / "ok.log", echo=False)
    assert job.lines == ["1", "2"] and (tmp_path / "ok.log").read_text() == "1\n2\n"
    said = runs.run("GREETING='hello there' python -c 'import os; print(os.environ[\"GREETING\"])'", timeout=60,
                    echo=False)
    assert said.lines == ["hello there"]
    with pytest.raises(LaunchError) as failed:
        runs.run("python -c 'raise ValueError(\"no such tag\")'", timeout=60, log=tmp_path / "bad.log", echo=False)
    assert str(failed.value).splitlines()[1:] == ["  ValueError: no such tag", f"  every line it printed: "
                                                  f"{tmp_path / 'bad.log'}"]
    start = time.monotonic()
    with pytest.raises(LaunchTimeout):
        runs.run(f"python -c 'import time; print(\"{tmp_path}\", flush=True); time.sleep(60)'", timeout=2, echo=False)
    assert time.monotonic() - start < 20 and not procs_mentioning(str(tmp_path))


@pytest.mark.fast
def test_the_permutation_test_notebook_06_teaches_is_the_one_notebook_09_imports():
    import ast
    import itertools

    from zckpt_nb.course.stats import chance

    nb = nbformat.read(next(p for p in notebook_paths() if p.name.startswith("06_")), as_version=4)
    cell = next(c.source for c in nb.cells if c.cell_type == "code" and "def chance(a, b):" in c.source)
    defs = [n for n in ast.parse(cell).body if isinstance(n, ast.FunctionDef) and n.name in ("wins", "chance")]
    space: dict = {"itertools": itertools}
    exec(compile(ast.Module(body=defs, type_ignores=[]), "06", "exec"), space)
    cases = [([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]), ([1, 3, 5, 7, 9], [2, 4, 6, 8, 10]), ([1, 2], [30, 40]),
             ([0.5, 0.5, 2.0], [0.5, 1.0, 3.0, 0.2]), ([3.0, 1.0, 2.0], [2.0, 2.0])]
    assert [space["chance"](a, b) for a, b in cases] == [chance(a, b) for a, b in cases]
