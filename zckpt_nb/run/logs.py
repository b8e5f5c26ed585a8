"""What a finished job's ranks printed, read back from its `launch.log`.
"""

from __future__ import annotations

import re
from pathlib import Path

from zckpt_nb.errors import LaunchError


def rank_lines(output_dir: str | Path, last: int = 3, skip: str = r"^step \d+/") -> dict[str, list[str]]:
    """What each rank really printed (from DIR/launch.log): its last `last` lines, progress lines skipped."""
    import re

    lines: dict[str, list[str]] = {}
    for line in (Path(output_dir) / "launch.log").read_text().splitlines():
        m = re.match(r"\[((?:node \d+ )?rank \d+)\] (.*)", line)
        if m and not re.match(skip, m.group(2)):
            lines.setdefault(m.group(1), []).append(m.group(2))
    return {who: found[-last:] for who, found in sorted(lines.items())}


def worker_error(err: LaunchError) -> str:
    """The one line a rank printed for a refused job (`zckpt_nb.train: error: ...`), out of the launch's message."""
    lines = [line.strip() for line in str(err).splitlines() if "zckpt_nb.train: error:" in line]
    return lines[0] if lines else str(err).splitlines()[0]


def rank_errors(output_dir: str | Path) -> dict[str, str]:
    """The last exception line each rank printed (from DIR/launch.log): what a failed job said, rank by rank."""
    pattern = re.compile(r"^[\w.]*(Error|Exception)\b")  # a traceback's last line, not its `raise ...` lines
    found = {who: [line.strip() for line in lines] for who, lines in rank_lines(output_dir, last=10**6).items()}
    return {who: next((line for line in reversed(lines) if pattern.match(line)), "(no exception)")
            for who, lines in found.items()}


def failure_summary(err: LaunchError, log_path: str | Path | None = None, most: int = 8) -> str:
    """A failed job in a few lines: its first line, then each distinct error line its ranks printed (at most `most`),
    then where the full log is; the whole message when no rank printed one (a timeout shows every rank's tail)."""
    errors = list(dict.fromkeys(line.strip().split("zckpt_nb.train: error: ", 1)[1]
                                for line in str(err).splitlines() if "zckpt_nb.train: error:" in line))
    if not errors:
        return str(err)
    where = f"\n  every rank's output: {log_path}" if log_path else ""
    return str(err).splitlines()[0] + "".join(f"\n  {e}" for e in errors[:most]) + where

