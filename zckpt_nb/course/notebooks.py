"""Execute the notebooks top to bottom (papermill), keeping executed copies and HTML under build/.

    python -m zckpt_nb.course.notebooks [--build build] [--only 01 02] [-p NAME VALUE ...]

A notebook fails when a cell raises or when a check it prints failed (`show.check`).
"""

from __future__ import annotations

import argparse
import ast
import sys
import time
from pathlib import Path
from typing import Any

from zckpt_nb.course.show import FAILED
from zckpt_nb.errors import UsageError

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def notebook_paths(nb_dir: Path = NOTEBOOKS, only: list[str] | None = None) -> list[Path]:
    """The numbered notebooks in order, optionally only those whose names start with a prefix in `only`."""
    paths = sorted(Path(nb_dir).glob("[0-9][0-9]_*.ipynb"))
    return [p for p in paths if not only or any(p.name.startswith(o) for o in only)]


def parameter_names(path: Path) -> list[str]:
    """The names the notebook's `parameters`-tagged cell assigns (what papermill's -p may set)."""
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


def ipc_kernel_manager() -> type:
    """A kernel manager whose kernel talks over local sockets (IPC), not TCP: nothing leaves the machine, and the
    kernel has no unencrypted TCP port to warn about. The sockets live in a temporary folder, not beside the
    notebook (a killed kernel would leave them there)."""
    import tempfile

    from jupyter_client.manager import AsyncKernelManager

    class IPCKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs: Any) -> None:
            ip = str(Path(tempfile.mkdtemp(prefix="zckpt-kernel-")) / "ipc")
            super().__init__(transport="ipc", ip=ip, **kwargs)

    return IPCKernelManager


def failed_checks(path: Path) -> list[str]:
    """Every line of an executed notebook's outputs that reports a failed check."""
    import nbformat

    texts = [o.get("text", "") for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"
             for o in c.get("outputs", []) if o.get("output_type") == "stream"]
    return [line for text in texts for line in text.splitlines() if line.startswith(FAILED)]


def execute(path: Path, build_dir: Path, parameters: dict[str, Any] | None = None) -> Path:
    """Run one notebook with its working directory beside it; write build/NAME.ipynb and .html."""
    import nbformat
    import papermill
    from nbconvert import HTMLExporter

    check_parameters(path, parameters or {})
    build_dir.mkdir(parents=True, exist_ok=True)
    out = build_dir / path.name
    papermill.execute_notebook(str(path), str(out), parameters=parameters or {}, cwd=str(path.parent),
                               kernel_name="python3", progress_bar=False, kernel_manager_class=ipc_kernel_manager())
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
            checks = failed_checks(execute(path, build_dir, parameters))
            status = f"FAILED: {len(checks)} checks failed, first: {checks[0]}" if checks else "ok"
        except Exception as e:  # report and go on: one broken notebook should not hide the others
            checks, status = [path.name], f"FAILED: {(str(e).strip().splitlines() or [type(e).__name__])[-1]}"
        if checks:
            failures.append(path.name)
        print(f"{path.name:<40} {time.perf_counter() - start:7.1f} s  {status}", flush=True)
    return failures


def parameter_value(text: str) -> object:
    """A `-p` value as Python reads it (3, [1, 3], None, 'tiny'); anything else stays a string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zckpt_nb.course.notebooks", description=__doc__.splitlines()[0])
    parser.add_argument("--notebooks", default=str(NOTEBOOKS))
    parser.add_argument("--build", default="build")
    parser.add_argument("--only", nargs="*", default=None, help="notebook name prefixes, e.g. 01 02")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                        help="set a notebook parameter (like papermill -p), e.g. -p WORLD_SIZES '[1, 3]'")
    args = parser.parse_args(argv)
    parameters = {name: parameter_value(value) for name, value in args.parameter}
    try:
        for path in notebook_paths(Path(args.notebooks), args.only):
            check_parameters(path, parameters)  # every unknown name refused before anything runs
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if run_all(Path(args.notebooks), Path(args.build), args.only, parameters) else 0


if __name__ == "__main__":
    sys.exit(main())
