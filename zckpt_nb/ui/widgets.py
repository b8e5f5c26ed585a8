"""An ipywidgets panel to compare save modes: pick world sizes, a preset and modes; run what is missing.

The logic (what to run, what to show) lives in `zckpt_nb.lessons.compare`; this module only wires controls to it, so a
test can set control values and press the buttons without a browser. The button runs the comparison in a
background thread, so the kernel stays responsive and Stop can end the job; every widget update from that thread
is a plain trait assignment (no `Output` capture, which would depend on the cell that happens to be running).
"""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import ipywidgets as w
import matplotlib.pyplot as plt

from zckpt_nb.errors import LaunchStopped
from zckpt_nb.format.records import Route
from zckpt_nb.lessons import compare
from zckpt_nb.lessons.compare import load_records
from zckpt_nb.model import PRESETS
from zckpt_nb.run.launch import progress_of
from zckpt_nb.ui.plots import plot_compare
from zckpt_nb.ui.tables import html_table

CAPTION = ("Each bar is one rank of one save mode at one world size. Left bars: the cost model's prediction; right "
           "bars: what was measured (tensor payload of the written files; DeepSpeed's comms logger).")


WIDE = {"description_width": "initial"}


def size_options(default_sizes: Iterable[int], world_sizes: Iterable[int] | None) -> list[int]:
    """The world sizes offered: those given (1, 2, 4 when none are) and every default one."""
    return sorted(set(default_sizes) | set((1, 2, 4) if world_sizes is None else world_sizes))


class CompareWidget:
    """Controls, Run and Stop, a status line with a step bar on top, then a chart and tables updated in place."""

    def __init__(self, output_dir: str | Path, *, default_sizes: tuple[int, ...] = (1, 2),
                 world_sizes: tuple[int, ...] | None = None, model: str = "tiny", presets: tuple[str, ...] = (),
                 default_modes: tuple[str, ...] = tuple(Route), steps: int = 5, timeout: float | None = None,
                 persistence_threshold: int = 0) -> None:
        """Offer `world_sizes` (1, 2, 4 by default) and `presets` (all by default) next to the defaults selected."""
        self.output_dir, self.steps, self.timeout = Path(output_dir), steps, timeout
        sizes = size_options(default_sizes, world_sizes)
        self.sizes = w.SelectMultiple(options=sizes, value=list(default_sizes), description="world sizes",
                                      rows=min(len(sizes), 6), style=WIDE)
        self.new_size = w.BoundedIntText(value=max(sizes) + 1, min=1, max=4096, description="add N",
                                         layout=w.Layout(width="150px"), style=WIDE)
        self.add_button = w.Button(description="add", tooltip="add this world size to the list and select it",
                                   layout=w.Layout(width="auto"))
        self.model = w.Dropdown(options=sorted(set(presets or PRESETS) | {model}), value=model, description="preset",
                                layout=w.Layout(width="200px"), style=WIDE)
        self.threshold = w.BoundedIntText(value=persistence_threshold, min=0, max=10**12,
                                          description="persistence threshold",
                                          tooltip="stage3_param_persistence_threshold (DeepSpeed's default: 100000)",
                                          layout=w.Layout(width="260px"), style=WIDE)
        self.modes = w.SelectMultiple(options=list(Route), value=list(default_modes), description="save modes",
                                      rows=len(Route), style=WIDE)
        self.button = w.Button(description="Run what is missing", button_style="primary", icon="play",
                               tooltip="measure the world sizes and modes not in compare.json yet, then redraw",
                               layout=w.Layout(width="auto"))
        self.stop_button = w.Button(description="Stop", button_style="danger", icon="stop", disabled=True,
                                    tooltip="kill every rank of the running job; what was measured stays",
                                    layout=w.Layout(width="auto"))
        self.progress = w.IntProgress(value=0, min=0, max=1, bar_style="info", style=WIDE,
                                      layout=w.Layout(width="260px", display="none"))
        self.status = w.HTML()
        self.title, self.table = w.HTML(), w.HTML()
        self.table.add_class("jp-RenderedHTMLCommon")  # JupyterLab's own table style (rules, aligned numbers)
        self.chart = w.Image(format="png", layout=w.Layout(max_width="900px"))
        self.button.on_click(self.on_click)
        self.stop_button.on_click(self.stop)
        self.add_button.on_click(self.add_size)
        self.records: list[dict[str, Any]] = []
        self.figure: Any = None
        self.summary: list[dict[str, Any]] = []  # what the table area shows (kept for tests and later cells)
        self.agreement: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def request(self) -> tuple[list[int], str, list[str]]:
        """What the controls ask for now."""
        return sorted(self.sizes.value), self.model.value, list(self.modes.value)

    def pending(self) -> list[int]:
        """World sizes the button would have to run (nothing measured for them yet)."""
        sizes, model, modes = self.request()
        return compare.missing(load_records(self.output_dir), model, sizes, modes, self.threshold.value)

    def add_size(self, _button: Any = None) -> None:
        """Offer the world size typed in `add N` and select it, next to those already selected."""
        n, chosen = self.new_size.value, set(self.sizes.value)
        self.sizes.options = sorted(set(self.sizes.options) | {n})  # this clears the selection
        self.sizes.value = sorted(chosen | {n})

    def on_click(self, _button: Any = None) -> None:
        """The Run button: start `run` in a background thread (nothing when one is running); `wait` joins it."""
        if self.running:
            return
        self.set_running(True)
        self._thread = threading.Thread(target=self.run, name="zckpt-compare", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether a comparison started by the button is still running."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the comparison started by the button has finished."""
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self, _button: Any = None) -> None:
        """The Stop button: end the running job (every rank is killed); the world sizes already measured stay."""
        self._stop.set()
        self.set_status("stopping: killing every rank ...")

    def run(self) -> None:
        """Measure what is missing, then redraw; synchronous (the button runs it in a thread)."""
        sizes, model, modes = self.request()
        self._stop.clear()
        self.set_running(True)
        message = "<b>interrupted</b>"
        try:
            self.records = compare.compare(sizes, model, modes, self.output_dir, steps=self.steps,
                                           timeout=self.timeout, progress=False, on_start=self.started,
                                           on_line=self.line, stop=self._stop,
                                           persistence_threshold=self.threshold.value)
            message = f"{len(self.records)} records for {model}, N = {sizes}"
        except LaunchStopped:
            self.records = compare.select(load_records(self.output_dir), model, sizes, modes,
                                          self.threshold.value)
            have = sorted({r["world_size"] for r in self.records})
            message = f"<b>stopped</b>: every rank was killed; kept what was measured for {model}: N = {have}"
        except Exception as e:  # show the one-line reason in the panel; the records already saved stay
            message = f"<b>failed:</b> {str(e).splitlines()[0]}"
        finally:  # the status says "done" only once the chart and tables show it
            self.refresh()
            self.set_running(False)
            self.set_status(message)

    def started(self, n: int) -> None:
        """`compare` is about to measure world size `n`: say so and reset the step bar."""
        self.set_status(f"measuring N = {n}: training, then the saves ...")
        self.progress.description, self.progress.value = f"N = {n}", 0

    def line(self, who: str, text: str) -> None:
        """Follow rank 0's `step k/n` lines on the step bar."""
        step = progress_of(text) if who == "rank 0" else None
        if step:
            self.progress.max, self.progress.value = step[1], step[0]

    def set_running(self, running: bool) -> None:
        self.button.disabled, self.stop_button.disabled = running, not running
        self.progress.layout.display = None if running else "none"  # the step bar shows only while a job runs

    def set_status(self, text: str) -> None:
        self.status.value = text

    def refresh(self) -> None:
        """Redraw the chart (title, image) and the tables from the current records."""
        sizes, model, _ = self.request()
        title = f"Save modes compared: {model}, N = {sizes}, persistence threshold {self.threshold.value:,}"
        self.title.value = f"<h3>{title}</h3>" if self.records else f"<h3>{title}: nothing measured yet</h3>"
        self.summary, self.agreement = compare.summary_rows(self.records), compare.agreement(self.records)
        if not self.records:
            self.chart.value, self.table.value = b"", ""
            return
        self.figure = plot_compare(self.records, title="", caption=CAPTION)
        png = io.BytesIO()
        self.figure.savefig(png, format="png", bbox_inches="tight")
        plt.close(self.figure)  # shown by the Image widget only, never again by the inline backend
        self.chart.value = png.getvalue()
        self.table.value = html_table(self.summary) + "<br>" + html_table(self.agreement)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        """The panel in Jupyter; the chart as a PNG where widgets do not render (HTML export, GitHub)."""
        bundle = self.view()._repr_mimebundle_(**kwargs)
        if self.chart.value:
            bundle["image/png"] = base64.b64encode(bytes(self.chart.value)).decode()
        return bundle

    def view(self) -> w.Widget:
        """The whole panel: controls, then Run/Stop with the status line and step bar, then chart and tables."""
        add = w.HBox([self.new_size, self.add_button])
        controls = w.HBox([w.VBox([self.sizes, add]), w.VBox([self.model, self.threshold]), self.modes])
        actions = w.HBox([self.button, self.stop_button, self.progress, self.status],
                         layout=w.Layout(align_items="center"))
        return w.VBox([controls, actions, self.title, self.chart, self.table])
