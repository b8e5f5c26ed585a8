"""What a finished job's ranks printed, read back from its `launch.log`."""

from __future__ import annotations

import re
from pathlib import Path

from zckpt_nb.errors import short_line

WORKER_ERROR = "zckpt_nb.train: error: "  # how the worker prints the one line of a refused or failed job
ANY_WORKER_ERROR = re.compile(r"zckpt_nb\.\w+: error: ")  # the same line from any of the package's workers
QUOTED_RANK = re.compile(r"^(?:node \d+ )?rank \d+: ")  # a line that names the rank it came from
EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception)\b")  # a traceback's last line, not its `raise ...` lines


def rank_lines(output_dir: str | Path, last: int = 3, skip: str = r"^step \d+/") -> dict[str, list[str]]:
    """What each rank really printed (from DIR/launch.log): its last `last` lines, progress lines skipped."""
    lines: dict[str, list[str]] = {}
    for line in (Path(output_dir) / "launch.log").read_text().splitlines():
        m = re.match(r"\[((?:node \d+ )?rank \d+)\] (.*)", line)
        if m and not re.match(skip, m.group(2)):
            lines.setdefault(m.group(1), []).append(m.group(2))
    return {who: found[-last:] for who, found in sorted(lines.items())}


def rank_error_line(lines: list[str]) -> str:
    """A rank's own error, out of what it printed: the worker's one-line error, else its last exception line."""
    mine = [line.strip() for line in lines if ANY_WORKER_ERROR.search(line)]
    if mine:
        return ANY_WORKER_ERROR.split(mine[-1], 1)[1]
    raised = [line.strip() for line in lines if EXCEPTION_LINE.match(line.strip())]
    return raised[-1] if raised else "printed no error (stopped from outside: killed, or ended by torchrun)"


def failure_report(err: Exception, output_dir: str | Path, width: int = 300) -> str:
    """A failed job in a few lines: the outcome, each distinct rank error line, and the log's path."""
    log = Path(output_dir) / "launch.log"
    found = rank_lines(output_dir, last=10**6) if log.is_file() else {}
    said: dict[str, str] = {}
    for who, printed in found.items():
        line = rank_error_line(printed).removeprefix(f"{who}: ")  # the worker's own lines start with the rank too
        quoted = QUOTED_RANK.match(line)
        origin, text = (quoted.group(0)[:-2], line[quoted.end():]) if quoted else (who, line)
        said.setdefault(f"{origin}: {text}", f"  {origin}: {short_line(text, width)}")
    lines = list(said.values())
    return "\n".join([str(err).splitlines()[0], *lines, f"  every rank's full output: {log}"])
