"""Every notebook runs top to bottom with its defaults (executed copies go to a temporary build dir)."""

from pathlib import Path

import nbformat
import pytest

from zckpt_nb.notebooks import execute, notebook_paths

NOTEBOOKS = notebook_paths(Path(__file__).resolve().parents[1] / "notebooks")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, tmp_path):
    out = execute(path, tmp_path, parameters={"OUTPUT_ROOT": str(tmp_path / "runs")})
    nb = nbformat.read(out, as_version=4)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert out.with_suffix(".html").stat().st_size > 10_000
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert images >= 2, "every notebook shows its measurements as plots"
