"""An ipywidgets panel to compare save modes: pick world sizes, a preset and modes; run what is missing.

The logic (what to run, what to show) lives in `zckpt_nb.compare`; this module only wires controls to it, so a
test can set control values and press the button without a browser.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ipywidgets as w
import matplotlib.pyplot as plt
from IPython.display import display

from zckpt_nb import compare
from zckpt_nb.measure import MODES
from zckpt_nb.model import PRESETS


class CompareWidget:
    """Controls, a run button, charts and a summary table that update in place."""

    def __init__(self, output_dir: str | Path, *, world_sizes: tuple[int, ...] = (1, 2, 4),
                 default_sizes: tuple[int, ...] = (1, 2), model: str = "tiny", steps: int = 5) -> None:
        self.output_dir, self.steps = Path(output_dir), steps
        self.sizes = w.SelectMultiple(options=list(world_sizes), value=list(default_sizes), description="world sizes")
        self.model = w.Dropdown(options=sorted(PRESETS), value=model, description="preset")
        self.modes = w.SelectMultiple(options=list(MODES), value=list(MODES), description="save modes")
        self.button = w.Button(description="Run missing and compare", button_style="primary", icon="play")
        self.status = w.HTML()
        self.charts, self.table = w.Output(), w.Output()
        self.button.on_click(self.on_click)
        self.records: list[dict[str, Any]] = []
        self.figure: Any = None
        self.summary: list[dict[str, Any]] = []  # what the table area shows (kept for tests and later cells)
        self.agreement: list[dict[str, Any]] = []

    def request(self) -> tuple[list[int], str, list[str]]:
        """What the controls ask for now."""
        return sorted(self.sizes.value), self.model.value, list(self.modes.value)

    def pending(self) -> list[int]:
        """World sizes the button would have to run (nothing measured for them yet)."""
        sizes, model, modes = self.request()
        return compare.missing(compare.load_records(self.output_dir), model, sizes, modes)

    def on_click(self, _button: Any = None) -> None:
        """Run what is missing through the launcher (progress bars appear in the charts area), then redraw."""
        sizes, model, modes = self.request()
        self.button.disabled = True
        try:
            with self.charts:
                self.records = compare.compare(sizes, model, modes, self.output_dir, steps=self.steps,
                                               on_start=lambda n: self.set_status(f"measuring N = {n} ..."))
            self.set_status(f"{len(self.records)} records for {model}, N = {sizes}")
            self.refresh()
        except Exception as e:  # show the one-line reason in the panel; the records already saved stay
            self.set_status(f"<b>failed:</b> {str(e).splitlines()[0]}")
        finally:
            self.button.disabled = False

    def set_status(self, text: str) -> None:
        self.status.value = text

    def refresh(self) -> None:
        """Redraw charts and table from the current records."""
        from zckpt_nb.plots import plot_compare, table

        self.charts.clear_output(wait=True)
        self.table.clear_output(wait=True)
        if self.figure is not None:
            plt.close(self.figure)
        sizes, model, _ = self.request()
        self.figure = plot_compare(self.records, title=f"Save modes compared: {model}, N = {sizes}",
                                   caption="Each bar is one rank of one save mode at one world size. Left bars: "
                                           "the cost model's prediction; right bars: what was measured (tensor "
                                           "payload of the written files; DeepSpeed's comms logger).")
        with self.charts:
            display(self.figure)
        self.summary, self.agreement = compare.summary_rows(self.records), compare.agreement(self.records)
        with self.table:
            display(table(self.summary))
            display(table(self.agreement))

    def view(self) -> w.Widget:
        """The whole panel."""
        controls = w.HBox([self.sizes, self.model, self.modes])
        return w.VBox([controls, w.HBox([self.button, self.status]), self.charts, self.table])


class PlanWidget:
    """A config, a world size and three bandwidths in; the plan table and its verdict out, on every change."""

    def __init__(self, configs: list[str], *, config: str, n: int, bw: Any, dtype: str = "bf16") -> None:
        self.config = w.Dropdown(options=configs, value=config, description="config")
        self.n = w.BoundedIntText(value=n, min=1, max=1_000_000, description="N (ranks)")
        self.dtype = w.Dropdown(options=["bf16", "fp32"], value=dtype, description="dtype")
        self.write = w.FloatText(value=bw.write_gbps, description="write GB/s")
        self.read = w.FloatText(value=bw.read_gbps, description="read GB/s")
        self.net = w.FloatText(value=bw.net_gbps, description="net GB/s")
        self.out = w.Output()
        self.rows: list[dict[str, Any]] = []
        self.sentence = ""  # what the panel shows under the table (kept for tests)
        for control in self.controls():
            control.observe(self.refresh, names="value")

    def controls(self) -> list[w.Widget]:
        return [self.config, self.n, self.dtype, self.write, self.read, self.net]

    def refresh(self, _change: Any = None) -> None:
        """Plan again from the controls (no launch: arithmetic on the config) and redraw the table."""
        from IPython.display import Markdown

        from zckpt_nb.launch import UsageError
        from zckpt_nb.planning import Bandwidths, plan, plan_table, verdict
        from zckpt_nb.plots import table

        self.out.clear_output(wait=True)
        try:
            bw = Bandwidths(self.write.value, self.read.value, self.net.value)
            self.rows = plan(self.config.value, self.n.value, bw, self.dtype.value)
            self.sentence = verdict(self.rows, bw)
        except UsageError as e:
            self.rows, self.sentence = [], f"**not planned:** {e}"
        with self.out:
            if self.rows:
                display(table(plan_table(self.rows)))
            display(Markdown(self.sentence))

    def view(self) -> w.Widget:
        """The whole panel."""
        return w.VBox([w.HBox(self.controls()[:3]), w.HBox(self.controls()[3:]), self.out])
