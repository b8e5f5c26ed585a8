"""The two README commands, the pins and the conda environment agree with pyproject.toml."""

import re
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # make test-fast

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ]", req.strip(), maxsplit=1)[0].lower()


def constraints() -> dict[str, str]:
    """constraints.txt: package name -> its exact version."""
    lines = [line.split("#")[0].strip() for line in (ROOT / "constraints.txt").read_text().splitlines()]
    return {_name(line): line.split("==")[1] for line in lines if line}


def test_every_dependency_has_a_range_whose_lower_bound_is_its_tested_version():
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = constraints()
    for dep in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
        req = Requirement(dep)
        assert not any(s.operator == "==" for s in req.specifier), f"{dep} is pinned exactly in pyproject.toml"
        lower = [s.version for s in req.specifier if s.operator == ">="]
        assert lower == [pinned[req.name.lower()]], f"{dep}: its lower bound is not the tested {pinned[req.name]}"
        assert req.specifier.contains(pinned[req.name.lower()])


def test_make_and_conda_install_the_constraints_torch_first():
    makefile, env = (ROOT / "Makefile").read_text(), (ROOT / "environment.yml").read_text()
    assert makefile.index("-c constraints.txt torch") < makefile.index("-c constraints.txt -e '.[dev]'")
    pip_lines = [line.strip()[2:] for line in env.splitlines() if line.strip().startswith("- ")]
    assert pip_lines.index("-c constraints.txt") < pip_lines.index("torch") < pip_lines.index("-e .")
    assert "python=3.11" in pip_lines and constraints()["torch"] == "2.13.0"


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
