"""Notebook 06's panel: the stall probe the notebook wrote, run for what its cells did not measure.

Pick world sizes (type any other in `add N`), save modes, a preset and the repeats; **Run what is missing** starts one
`torchrun` job per world size without timings, in a background thread so the kernel stays free, then draws every
world size selected side by side (nothing is drawn before: the notebook's cells show their own run), and **Stop**
kills every process of it. The chart and the table are drawn by the notebook's own functions (`draw`, `rows`), so
what the panel shows is computed the way the cells teach. Widget updates from the thread are plain trait assignments.
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import ipywidgets as w
import matplotlib.pyplot as plt

from zckpt_nb.course import runs
from zckpt_nb.course.show import table
from zckpt_nb.format.records import SaveMode
from zckpt_nb.model import PRESETS
from zckpt_nb.run.launch import kill_tree, read_lines

PROGRESS = re.compile(r"save (\d+)/(\d+)")  # what the probe's rank 0 prints after each save
WIDE = {"description_width": "initial"}
Records = list[dict[str, Any]]


def probe_dir(root: str | Path, model: str, dtype: str, threshold: int, n: int) -> Path:
    """Where the probe's timings for these settings and `n` ranks live (the cells and the panel agree on it)."""
    return Path(root) / f"{model}_{dtype}_t{threshold}_n{n}"


def listed(sizes: Iterable[int]) -> str:
    """World sizes as a reader writes them: `2`, or `1, 3`."""
    return ", ".join(map(str, sorted(sizes))) or "none"


def timings(folder: Path, n: int) -> Records | None:
    """Every rank's records in `folder`, or None while any rank's file is missing."""
    files = [folder / f"timings_rank{rank}.json" for rank in range(n)]
    return [r for f in files for r in json.loads(f.read_text())] if all(f.is_file() for f in files) else None


class StallPanel:
    """Controls, Run and Stop, a status line with a step bar, then a chart and a table redrawn in place."""

    def __init__(self, script: Path, root: Path, *, model: str, dtype: str, threshold: int, sizes: Sequence[int],
                 modes: Sequence[str], repeats: int, steps_between: int, timeout: float,
                 draw: Callable[[dict[int, Records], list[str], str], Any],
                 rows: Callable[[Records, list[str]], Records]) -> None:
        self.script, self.root, self.dtype, self.threshold = Path(script), Path(root), dtype, threshold
        self.steps_between, self.timeout, self.draw, self.rows = steps_between, timeout, draw, rows
        offered = sorted({1, 2, 3, *sizes})
        self.sizes = w.SelectMultiple(options=offered, value=list(sizes), description="world sizes", rows=4,
                                      style=WIDE)
        self.new_size = w.BoundedIntText(value=max(offered) + 1, min=1, max=64, description="add N", style=WIDE,
                                         layout=w.Layout(width="150px"))
        self.add_button = w.Button(description="add", layout=w.Layout(width="auto"),
                                   tooltip="add this world size to the list and select it")
        self.modes = w.SelectMultiple(options=[str(m) for m in (SaveMode.PLAIN, SaveMode.COMMIT, SaveMode.ASYNC)],
                                      value=[str(m) for m in modes], description="save modes", rows=3, style=WIDE)
        self.model = w.Dropdown(options=sorted(set(PRESETS) - {"xl"}), value=model, description="preset",
                                layout=w.Layout(width="200px"), style=WIDE)
        self.repeats = w.BoundedIntText(value=repeats, min=1, max=50, description="repeats", style=WIDE,
                                        layout=w.Layout(width="150px"))
        self.button = w.Button(description="Run what is missing", button_style="primary", icon="play",
                               tooltip="time the world sizes that have no timings yet, then redraw")
        self.stop_button = w.Button(description="Stop", button_style="danger", icon="stop", disabled=True,
                                    tooltip="kill every rank of the running job; what was measured stays")
        self.progress = w.IntProgress(value=0, min=0, max=1, bar_style="info", style=WIDE,
                                      layout=w.Layout(width="240px", display="none"))
        self.status, self.title, self.table = w.HTML(), w.HTML(), w.HTML()
        self.table.add_class("jp-RenderedHTMLCommon")  # JupyterLab's own table style
        self.chart = w.Image(format="png", layout=w.Layout(max_width="1000px"))
        self.button.on_click(self.on_click)
        self.stop_button.on_click(self.stop)
        self.add_button.on_click(self.add_size)
        self.shown: dict[int, Records] = {}  # what the chart and table show, by world size
        self._stop, self._thread = threading.Event(), None
        self.status.value = f"nothing drawn yet; Run what is missing times N = {listed(self.pending())}, then draws"

    def folder(self, n: int) -> Path:
        return probe_dir(self.root, self.model.value, self.dtype, self.threshold, n)

    def measured(self, n: int) -> Records | None:
        """The timings for `n` ranks if they hold every selected mode at least `repeats` times, else None."""
        found = timings(self.folder(n), n)
        enough = found is not None and all(
            sum(r["mode"] == m and r["rank"] == 0 for r in found) >= self.repeats.value for m in self.modes.value)
        return found if enough else None

    def pending(self) -> list[int]:
        """The selected world sizes the button would measure."""
        return [n for n in sorted(self.sizes.value) if self.measured(n) is None]

    def command(self, n: int) -> str:
        """The torchrun line that times `n` ranks, as a learner would type it."""
        return (f"torchrun --nproc_per_node {n} {self.script} {self.folder(n)} --modes {' '.join(self.modes.value)} "
                f"--repeats {self.repeats.value} --steps_between {self.steps_between} --model {self.model.value} "
                f"--dtype {self.dtype} --persistence_threshold {self.threshold}")

    def add_size(self, _button: Any = None) -> None:
        """Offer the world size typed in `add N` and select it beside those already selected."""
        n, chosen = self.new_size.value, set(self.sizes.value)
        self.sizes.options = sorted(set(self.sizes.options) | {n})  # this clears the selection
        self.sizes.value = sorted(chosen | {n})

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def on_click(self, _button: Any = None) -> None:
        """The Run button: `run` in a background thread (nothing while one runs); `wait` joins it."""
        if not self.running:
            self.set_running(True)
            self._thread = threading.Thread(target=self.run, name="zckpt-stall-panel", daemon=True)
            self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self, _button: Any = None) -> None:
        """The Stop button: the running job's every process is killed; the world sizes done stay."""
        self._stop.set()
        self.status.value = "stopping: killing every rank ..."

    def run(self) -> None:
        """Time every pending world size, then redraw (synchronous; the button runs it in a thread)."""
        self._stop.clear()
        self.set_running(True)
        message = ""
        try:
            for n in self.pending():
                self.measure(n)
            message = f"timings for {self.model.value}, N = {listed(self.sizes.value)}"
        except Exception as e:  # one line in the panel; what was measured before stays on disk
            message = f"<b>failed:</b> {str(e).splitlines()[0]}"
        finally:  # the status says done only once the chart and the table show it
            self.refresh()
            self.set_running(False)
            if self._stop.is_set():
                message = f"<b>stopped</b>: every rank was killed; kept N = {listed(self.shown)}"
            self.status.value = message

    def measure(self, n: int) -> None:
        """One torchrun job for `n` ranks, its rank 0's progress on the bar; killed on Stop or past the timeout."""
        self.status.value = f"measuring N = {n}: {self.command(n)}"
        self.progress.description, self.progress.value = f"N = {n}", 0
        command = self.command(n)
        self.folder(n).mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(runs.argv(command), env=runs.environment(command), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        lines = []
        try:
            for line in read_lines(proc, time.monotonic() + self.timeout, self._stop):
                lines.append(line)
                found = PROGRESS.search(line)
                if found:
                    self.progress.max, self.progress.value = int(found.group(2)), int(found.group(1))
        finally:
            if proc.poll() is None:
                kill_tree(proc)
            (self.folder(n) / "launch.log").write_text("\n".join(lines) + "\n")
        if self._stop.is_set():
            raise InterruptedError(f"stopped at N = {n}")
        if proc.wait():
            raise RuntimeError(runs.failure(runs.Job(command, lines, 0.0), proc.returncode, self.folder(n)
                                            / "launch.log"))

    def set_running(self, running: bool) -> None:
        self.button.disabled, self.stop_button.disabled = running, not running
        self.progress.layout.display = None if running else "none"  # the bar shows only while a job runs

    def refresh(self) -> None:
        """Redraw the chart and the table from the timings on disk for the selected world sizes."""
        modes = list(self.modes.value)
        self.shown = {n: found for n in sorted(self.sizes.value) if (found := self.measured(n)) is not None}
        title = f"Stalls of {self.model.value} in {self.dtype}, N = {listed(self.sizes.value)}"
        self.title.value = f"<h3>{title}</h3>" if self.shown else f"<h3>{title}: nothing measured yet</h3>"
        if not self.shown:
            self.chart.value, self.table.value = b"", ""
            return
        fig = self.draw(self.shown, modes, title)
        png = io.BytesIO()
        fig.savefig(png, format="png", bbox_inches="tight", dpi=90)
        plt.close(fig)  # shown by the Image widget only, never again by the inline backend
        self.chart.value = png.getvalue()
        rows = [{"N": n, **row} for n, found in self.shown.items() for row in self.rows(found, modes)]
        self.table.value = table(rows)._repr_html_()

    def view(self) -> w.Widget:
        """Controls, then Run and Stop with the status line and the bar, then the title, chart and table."""
        controls = w.HBox([w.VBox([self.sizes, w.HBox([self.new_size, self.add_button])]), self.modes,
                           w.VBox([self.model, self.repeats])])
        actions = w.HBox([self.button, self.stop_button, self.progress, self.status],
                         layout=w.Layout(align_items="center"))
        return w.VBox([controls, actions, self.title, self.chart, self.table])

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        """The panel in Jupyter; where widgets do not render (the HTML export, GitHub), one line of text in place of the
        widgets' repr, and its chart as a PNG."""
        bundle = self.view()._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = (f"StallPanel: interactive, it needs Jupyter with a running kernel; N = "
                                f"{listed(self.sizes.value)} selected, {listed(self.pending())} without timings yet")
        bundle["text/html"] = f"<p><i>{html.escape(bundle['text/plain'])}</i></p>"  # for viewers without widgets
        if self.chart.value:
            bundle["image/png"] = base64.b64encode(bytes(self.chart.value)).decode()
        return bundle
