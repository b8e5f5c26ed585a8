"""The two README commands, the pins and the conda environment agree with pyproject.toml."""

import re
from pathlib import Path

import pytest
import tomllib

pytestmark = pytest.mark.fast  # make test-fast

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ]", req.strip(), maxsplit=1)[0].lower()


def test_environment_yml_lists_every_dependency_in_order():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pip_lines = [line.strip()[2:] for line in (ROOT / "environment.yml").read_text().splitlines()
                 if line.strip().startswith("- ") and not line.strip().startswith("- pip:")]
    names = [_name(x) for x in pip_lines]
    for dep in deps:
        assert _name(dep) in names, f"environment.yml lacks {dep}"
        assert dep in pip_lines, f"environment.yml pins {dep} differently"
    assert names.index("torch") < names.index("deepspeed"), "torch must come before deepspeed"
    assert "-e ." in pip_lines and "python=3.11" in pip_lines


def test_torch_is_pinned_exactly_to_the_cpu_build_version():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch==2.13.0" in deps
    assert "pip install torch==2.13.0" in (ROOT / "Makefile").read_text()


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make notebooks" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_notebooks_are_committed_without_outputs():
    import nbformat

    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        assert nb.cells[0].source.startswith("# "), f"{path.name} must open with an H1"
        assert any("parameters" in c.metadata.get("tags", []) for c in nb.cells), f"{path.name}: no parameters cell"
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name} carries outputs"
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
        for heading in ("What you will learn", "Prerequisites", "Expected run time", "Summary"):
            assert heading in text, f"{path.name} lacks '{heading}'"


def test_package_data_ships_every_config_and_data_file():
    from fnmatch import fnmatch

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["zckpt_nb"]
    package = ROOT / "zckpt_nb"
    files = [p.relative_to(package).as_posix() for d in ("configs", "data") for p in (package / d).iterdir()]
    assert any(f.startswith("configs/") for f in files)
    for f in files:
        assert any(fnmatch(f, pattern) for pattern in patterns), f"pyproject's package-data leaves out {f}"
