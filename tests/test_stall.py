"""Notebook 06's stall probe and panel, run as the notebook runs them (its own cells, real ranks), and the memory
counters a save's figures sit beside."""

import ast
import itertools
import statistics
import time
from pathlib import Path

import matplotlib.pyplot as plt
import nbformat
import pytest
import torch
from conftest import procs_mentioning
from matplotlib.patches import Patch
from matplotlib.ticker import LogLocator, NullFormatter, StrMethodFormatter

from zckpt_nb import SaveMode
from zckpt_nb.course.panel import StallPanel, probe_dir
from zckpt_nb.course.plots import caption
from zckpt_nb.measure import meters

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "06_save_modes_and_stalls.ipynb"


def cells() -> list[str]:
    return [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]


def probe(folder: Path) -> Path:
    """The probe script of the notebook's `%%writefile` cells (the first, then each `%%writefile -a`), in `folder`."""
    parts = [c.split("\n", 1)[1] for c in cells()
             if c.startswith("%%writefile") and "stall_probe.py" in c.split("\n", 1)[0]]
    path = folder / "stall_probe.py"
    path.write_text("\n".join(parts) + "\n")
    return path


def lesson() -> dict:
    """The functions notebook 06's cells define (`stalls`, `ms`, `spread_rows`, `draw`, `wins`, `chance`), without
    the cells' other lines (which read the notebook's own run)."""
    names = {"plt": plt, "statistics": statistics, "caption": caption, "itertools": itertools,
             "StrMethodFormatter": StrMethodFormatter, "LogLocator": LogLocator, "NullFormatter": NullFormatter,
             "Patch": Patch, "SaveMode": SaveMode}
    for source in cells():
        if not source.startswith("%"):
            tree = ast.parse(source)
            tree.body = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
            exec(compile(tree, str(NOTEBOOK), "exec"), names)
    return names


def panel_for(root: Path, **options) -> StallPanel:
    names = lesson()
    settings = {"model": "tiny", "dtype": "fp32", "threshold": 0, "sizes": [1], "modes": ["plain"], "repeats": 1,
                "steps_between": 1, "timeout": 300} | options
    return StallPanel(probe(root), root, draw=names["draw"], rows=names["spread_rows"], **settings)


def test_the_tie_test_counts_the_splits_as_lopsided_as_the_measured_one():
    chance = lesson()["chance"]
    assert chance([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) == pytest.approx(2 / 252)  # the two most lopsided of 252
    assert chance([1, 3, 5, 7, 9], [2, 4, 6, 8, 10]) > 0.5  # interleaved: most splits are as far from even
    assert chance([1, 2], [3, 4]) == pytest.approx(2 / 6)  # two repeats each can never go below 33%


def test_the_panel_offers_any_world_size_and_adds_typed_ones(tmp_path):
    panel = panel_for(tmp_path, sizes=[3])
    assert list(panel.sizes.options) == [1, 2, 3] and panel.sizes.value == (3,)
    panel.new_size.value = 6
    panel.add_button.click()
    assert list(panel.sizes.options) == [1, 2, 3, 6] and panel.sizes.value == (3, 6)
    assert panel.pending() == [3, 6]
    assert panel.command(6).startswith(f"torchrun --nproc_per_node 6 {tmp_path / 'stall_probe.py'} "
                                       f"{probe_dir(tmp_path, 'tiny', 'fp32', 0, 6)} --modes plain --repeats 1")


def test_the_panel_measures_what_is_missing_in_the_background_and_redraws(tmp_path):
    panel = panel_for(tmp_path, sizes=[1], modes=["plain", "commit"], repeats=2)
    started = time.monotonic()
    panel.button.click()  # a background thread: the kernel stays free while ranks train
    assert time.monotonic() - started < 5 and panel.running  # far less than the launch it started (tens of seconds)
    panel.wait(timeout=300)
    assert not panel.running and not panel.button.disabled and panel.stop_button.disabled
    assert panel.status.value == "timings for tiny, N = 1", panel.status.value
    assert list(panel.shown) == [1] and len(panel.shown[1]) == 4  # 2 modes x 2 repeats x 1 rank
    assert bytes(panel.chart.value).startswith(b"\x89PNG") and "N = 1" in panel.title.value
    assert panel.table.value.count("<tr>") == 3 and "<th>N</th>" in panel.table.value  # a header and 2 modes
    assert panel.pending() == []  # measured once, not again
    panel.repeats.value = 3
    assert panel.pending() == [1]  # more repeats asked than measured


def test_stop_kills_every_rank_and_keeps_what_was_measured(tmp_path):
    panel = panel_for(tmp_path, sizes=[2], modes=["commit"], repeats=50, steps_between=20)
    panel.button.click()
    deadline = time.monotonic() + 300
    while panel.progress.value < 1 and panel.running and time.monotonic() < deadline:
        time.sleep(0.5)  # wait for rank 0's first save: every rank is up and saving
    assert panel.progress.value >= 1 and panel.progress.description == "N = 2", panel.status.value
    assert len(procs_mentioning(str(tmp_path))) >= 3  # torchrun and its 2 ranks
    panel.stop_button.click()
    panel.wait(timeout=60)
    assert not panel.running and "stopped" in panel.status.value, panel.status.value
    assert procs_mentioning(str(tmp_path)) == []
    assert panel.shown == {} and "nothing measured yet" in panel.title.value


def test_resetting_the_kernel_rss_peak_keeps_the_run_wide_peak():
    big = torch.ones(25_000_000)  # 100 MB resident
    before = meters.host_peak_bytes()
    del big
    if not meters.reset_rss_high_water():
        pytest.skip("this kernel refuses /proc/self/clear_refs (HostMemory samples RSS instead)")
    assert meters.rss_high_water() < before - 50 * 2**20  # the kernel's counter restarted ...
    assert meters.host_peak_bytes() >= before  # ... and run.json's peak did not
