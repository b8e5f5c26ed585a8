"""Lines of the installed DeepSpeed (or another package) as notebooks 07, 08 and 09 print them: found by their text,
never by a line number, so an excerpt follows the installed version; the header names the version, the file, the
lines and the function."""

from __future__ import annotations

import textwrap
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path


def deepspeed_file(path: str, package: str = "deepspeed") -> Path:
    """`path` (e.g. "runtime/engine.py") inside the installed `package` (deepspeed unless named)."""
    return Path(find_spec(package).submodule_search_locations[0]) / path


def quote(path: str, first: str, last: str | None = None, *, start: str | None = None,
          package: str = "deepspeed") -> str:
    """The lines of DeepSpeed's `path` (or another installed `package`'s) from the first one holding `first` (after
    the line holding `start`, when given) to the next one holding `last` (or that line alone), dedented, under a
    header naming where they are."""
    lines = deepspeed_file(path, package).read_text().splitlines()
    begin = next(i for i, line in enumerate(lines) if start in line) if start else 0
    a = next(i for i in range(begin, len(lines)) if first in lines[i])
    b = next(i for i in range(a, len(lines)) if last in lines[i]) if last else a
    func = next((lines[j].split("def ", 1)[1].split("(")[0] for j in range(a, -1, -1)
                 if lines[j].lstrip().startswith("def ")), "the module")
    where = f"line {a + 1}" if a == b else f"lines {a + 1} to {b + 1}"
    body = textwrap.indent(textwrap.dedent("\n".join(lines[a:b + 1])), "    " if a == b else "")
    name = "DeepSpeed" if package == "deepspeed" else package
    return f"{name} {version(package)}, {path}, {where}, in {func}:\n{body}"
