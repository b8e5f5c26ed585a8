"""The package's shape (docs/architecture.md): no import cycle, every import goes down the layers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # make test-fast

PKG = Path(__file__).resolve().parents[1] / "zckpt_nb"
# The library bottom to top, then the course above it (docs/architecture.md). A module may import its own layer's
# modules and any lower layer's, never a higher one's: no library module imports the course, and the save path
# (saving/) imports nothing that launches or injects faults (run/).
LAYERS = [
    ("foundation", ["zckpt_nb.errors", "zckpt_nb.format", "zckpt_nb.model", "zckpt_nb.data"]),
    ("measure", ["zckpt_nb.measure"]),
    ("convert and plan", ["zckpt_nb.convert", "zckpt_nb.plan"]),
    ("saving", ["zckpt_nb.saving"]),
    ("run", ["zckpt_nb.run"]),
    ("entry points", ["zckpt_nb.train", "zckpt_nb.cli", "zckpt_nb.__main__", "zckpt_nb"]),
    ("course", ["zckpt_nb.course", "zckpt_nb.examples"]),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix naming `module`."""
    best = max(((len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
                if module == p or module.startswith(p + ".")), default=None)
    assert best is not None, f"{module} is in no layer of docs/architecture.md"
    return best[1]


def package_imports(path: Path) -> set[str]:
    """Every zckpt_nb module `path` imports, at the top or inside a function (absolute imports only here)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zckpt_nb"):
            assert node.level == 0
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if (PKG.parent / full.replace(".", "/")).with_suffix(".py").exists()
                          or (PKG.parent / full.replace(".", "/")).is_dir() else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("zckpt_nb")}
    return found


def test_every_import_goes_down_the_layers() -> None:
    upward = []
    for path in sorted(PKG.rglob("*.py")):
        me = module_name(path)
        for other in package_imports(path):
            if layer_of(other) > layer_of(me):
                upward.append(f"{me} ({LAYERS[layer_of(me)][0]}) imports {other} ({LAYERS[layer_of(other)][0]})")
    assert not upward, "\n".join(upward)


def test_convert_and_plan_do_not_import_each_other() -> None:
    for path in sorted(PKG.rglob("*.py")):
        me = module_name(path)
        for other in package_imports(path):
            for a, b in (("zckpt_nb.convert", "zckpt_nb.plan"), ("zckpt_nb.plan", "zckpt_nb.convert")):
                assert not (me.startswith(a) and other.startswith(b)), f"{me} imports {other}"
