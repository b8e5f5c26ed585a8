"""What a finished job's ranks printed, read back from its `launch.log`."""

from __future__ import annotations

import re
from pathlib import Path

from zckpt_nb.errors import LaunchError, short_line

WORKER_ERROR = "zckpt_nb.train: error: "  # how the worker prints the one line of a refused or failed job
EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception)\b")  # a traceback's last line, not its `raise ...` lines


def rank_lines(output_dir: str | Path, last: int = 3, skip: str = r"^step \d+/") -> dict[str, list[str]]:
    """What each rank really printed (from DIR/launch.log): its last `last` lines, progress lines skipped."""
    lines: dict[str, list[str]] = {}
    for line in (Path(output_dir) / "launch.log").read_text().splitlines():
        m = re.match(r"\[((?:node \d+ )?rank \d+)\] (.*)", line)
        if m and not re.match(skip, m.group(2)):
            lines.setdefault(m.group(1), []).append(m.group(2))
    return {who: found[-last:] for who, found in sorted(lines.items())}


def worker_error(err: LaunchError) -> str:
    """The one line a rank printed for a refused job (`zckpt_nb.train: error: ...`), out of the launch's message."""
    lines = [line.strip() for line in str(err).splitlines() if WORKER_ERROR in line]
    return lines[0] if lines else str(err).splitlines()[0]


def rank_errors(output_dir: str | Path) -> dict[str, str]:
    """The last exception line each rank printed (from DIR/launch.log): what a failed job said, rank by rank."""
    found = {who: [line.strip() for line in lines] for who, lines in rank_lines(output_dir, last=10**6).items()}
    return {who: next((line for line in reversed(lines) if EXCEPTION_LINE.match(line)), "(no exception)")
            for who, lines in found.items()}


def rank_error_line(lines: list[str]) -> str:
    """A rank's own error, out of what it printed: the worker's one-line error, else its last exception line."""
    mine = [line.strip() for line in lines if WORKER_ERROR in line]
    if mine:
        return mine[-1].split(WORKER_ERROR, 1)[1]
    raised = [line.strip() for line in lines if EXCEPTION_LINE.match(line.strip())]
    return raised[-1] if raised else "printed no error (stopped from outside: killed, or ended by torchrun)"


def failure_report(err: Exception, output_dir: str | Path, width: int = 300) -> str:
    """A failed job in N + 2 lines: the outcome, each rank's own error line (from DIR/launch.log, `short_line`),
    and the path of the full log (timeouts too)."""
    log = Path(output_dir) / "launch.log"
    found = rank_lines(output_dir, last=10**6) if log.is_file() else {}
    lines = [str(err).splitlines()[0]]
    for who, printed in found.items():
        line = rank_error_line(printed).removeprefix(f"{who}: ")  # the worker's own lines start with the rank too
        lines.append(f"  {who}: {short_line(line, width)}")
    return "\n".join(lines + [f"  every rank's full output: {log}"])
