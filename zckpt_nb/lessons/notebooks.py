"""Execute the notebooks top to bottom (papermill), keeping executed copies and HTML under build/.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from zckpt_nb.errors import UsageError


def notebook_paths(nb_dir: Path, only: list[str] | None = None) -> list[Path]:
    """The numbered notebooks in order, optionally only those whose names start with a prefix in `only`."""
    paths = sorted(nb_dir.glob("[0-9][0-9]_*.ipynb"))
    return [p for p in paths if not only or any(p.name.startswith(o) for o in only)]


def parameter_names(path: Path) -> list[str]:
    """The names the notebook's `parameters`-tagged cell assigns (what papermill's -p may set)."""
    import ast

    import nbformat

    cells = [c for c in nbformat.read(path, as_version=4).cells if "parameters" in c.metadata.get("tags", [])]
    tree = ast.parse(cells[0].source) if cells else ast.Module(body=[], type_ignores=[])
    return [t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)]


def check_parameters(path: Path, parameters: dict[str, Any]) -> None:
    """Refuse a parameter the notebook does not take (papermill would set it silently and run the defaults)."""
    known = parameter_names(path)
    unknown = sorted(set(parameters) - set(known))
    if unknown:
        raise UsageError(f"{path.name} takes no parameter {', '.join(unknown)}; it takes {', '.join(known)}")


def execute(path: Path, build_dir: Path, parameters: dict[str, Any] | None = None) -> Path:
    """Run one notebook with its working directory beside it; write build/NAME.ipynb and .html."""
    import nbformat
    import papermill
    from nbconvert import HTMLExporter

    check_parameters(path, parameters or {})
    build_dir.mkdir(parents=True, exist_ok=True)
    out = build_dir / path.name
    papermill.execute_notebook(str(path), str(out), parameters=parameters or {}, cwd=str(path.parent),
                               kernel_name="python3", progress_bar=False)
    html, _ = HTMLExporter().from_notebook_node(nbformat.read(out, as_version=4))
    out.with_suffix(".html").write_text(html, encoding="utf-8")
    return out


def run_all(nb_dir: Path, build_dir: Path, only: list[str] | None = None,
            parameters: dict[str, Any] | None = None) -> list[str]:
    """Execute every notebook, print one line each with its run time; return the names that failed."""
    failures = []
    for path in notebook_paths(nb_dir, only):
        start = time.perf_counter()
        try:
            execute(path, build_dir, parameters)
            status = "ok"
        except Exception as e:  # report and go on: one broken notebook should not hide the others
            status = f"FAILED: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
            failures.append(path.name)
        print(f"{path.name:<40} {time.perf_counter() - start:7.1f} s  {status}", flush=True)
    return failures
