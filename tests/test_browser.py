"""JupyterLab for real: headless Chromium opens notebook 06, runs every cell, then uses the panel as a person would:
it draws the cells' world size beside one it measures on a click.

The lab serves a fresh copy of the notebook (parameters injected so Run All stays short) from a temporary folder,
so no output ever lands in notebooks/. Screenshots go to build/browser/ for a person to look at.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nbformat
import psutil
import pytest
from conftest import procs_mentioning

from zckpt_nb.run.launch import free_port, kill_tree

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
SHOTS = ROOT / "build" / "browser"
NOTEBOOK = "06_save_modes_and_stalls.ipynb"
PARAMETERS = {"NPROC": 1, "REPEATS": 2}  # Run All measures N = 1; the panel then draws N = 1 beside N = 3
LAB_SETTINGS = {  # every cell stays in the page (no virtual scrolling); the notebook's kernel starts without asking;
    # no news pop-up over the screenshots
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings":
        '{"windowingMode": "none", "autoStartDefaultKernel": true}',
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": '{"fetchNews": "false"}',
}


def chromium() -> str:
    """Debian's chromium: installed with apt-get when missing and running as root; otherwise fail in one line."""
    if not CHROMIUM.exists():
        if os.geteuid() != 0:
            pytest.fail("the browser test needs Debian's chromium: run `sudo apt-get install -y chromium`",
                        pytrace=False)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium"]):
            subprocess.run(cmd, check=True, env=env, timeout=900, stdout=subprocess.DEVNULL)
    return str(CHROMIUM)


def copy_notebook(dst: Path) -> None:
    """Notebook 06 with the short-run parameters injected after its parameters cell (papermill's way)."""
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    nb = load_notebook_node(str(ROOT / "notebooks" / NOTEBOOK))
    nbformat.write(parameterize_notebook(nb, PARAMETERS), dst / NOTEBOOK)


def wait_until_up(url: str, server: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    """Return once the server answers on `url`; fail with its log if it dies or never answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, f"JupyterLab exited:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"JupyterLab did not answer within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and every descendant (none once it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[str]:
    """JupyterLab on a free loopback port with a token, serving a copy of notebook 06; yields its /lab URL."""
    root, settings = tmp_path / "notebooks", tmp_path / "lab-settings"
    root.mkdir()
    copy_notebook(root)
    for name, text in LAB_SETTINGS.items():
        (settings / name).parent.mkdir(parents=True, exist_ok=True)
        (settings / name).write_text(text)
    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"), JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    log = tmp_path / "lab.log"
    with log.open("w") as out:  # the kernel is the server's own python (jupyter_client's native python3 kernel)
        server = subprocess.Popen([sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
                                   "--ServerApp.ip=127.0.0.1",
                                   f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
                                   f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}"],
                                  cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_up(f"http://127.0.0.1:{port}/api/status?token={token}", server, log)
        yield f"http://127.0.0.1:{port}/lab?token={token}"
    finally:
        tree = process_tree(server.pid)
        kill_tree(server)
        _, alive = psutil.wait_procs(tree, timeout=5)
        assert not alive, f"processes of the lab outlived it: {alive}"
        assert procs_mentioning(str(tmp_path)) == [], "a process of the test (kernel, rank, browser) is left"


def run_all_cells(page) -> None:
    """Run > Run All Cells, as a person would; return once the last code cell ran or a cell failed."""
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    page.wait_for_function("""() => {  // the last cell ran, or a cell failed (Run All stops there)
        const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')];
        const errors = [...document.querySelectorAll('.jp-OutputArea-output')].filter(
            o => o.textContent.includes('Traceback'));
        return errors.length > 0 || (prompts.length > 0 && /\\[\\d+\\]/.test(prompts.at(-1).textContent));
    }""", timeout=600_000, polling=1000)


def test_notebook_06_runs_in_jupyterlab_and_its_panel_measures_a_new_world_size(lab, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(str(tmp_path / "chromium-profile"), headless=True,
                                                       executable_path=chromium(),
                                                       viewport={"width": 1400, "height": 1800})
        try:
            page = browser.pages[0]
            page.goto(lab)
            page.locator(".jp-DirListing-item", has_text=NOTEBOOK).dblclick()  # open it as a person would
            expect(page.locator(".jp-StatusBar-Widget", has_text="Python 3 (ipykernel) | Idle")).to_be_visible(
                timeout=120_000)
            run_all_cells(page)
            outputs = page.locator(".jp-Notebook .jp-OutputArea").all_inner_texts()
            assert not [t for t in outputs if "Traceback" in t or "Error displaying widget" in t], outputs
            prompts = page.locator(".jp-CodeCell .jp-InputArea-prompt").all_inner_texts()
            assert all(re.fullmatch(r"\[\d+\]:", t.strip()) for t in prompts), prompts  # every cell ran

            panel = page.locator(".widget-vbox").filter(has=page.get_by_role("button", name="Run what is missing"))
            title, status, table = panel.locator("h3"), panel.locator(".widget-html").nth(0), panel.locator("table")
            # nothing drawn before a click (the cells show their own run); the status says what Run would time
            expect(status).to_contain_text("Run what is missing times N = 2, 3")  # NPROC + 1, + 2: the cells measured 1
            assert table.count() == 0
            before = panel.locator("img").get_attribute("src")
            panel.scroll_into_view_if_needed()
            panel.screenshot(path=SHOTS / "panel_before.png")

            panel.locator(".widget-text", has_text="add N").locator("input").fill("3")
            panel.get_by_role("button", name="add", exact=True).click()
            sizes = panel.locator(".widget-select-multiple", has_text="world sizes").locator("select")
            expect(sizes.locator("option", has_text="3")).to_have_count(1)
            sizes.select_option(label=["1", "3"])  # the cells' N = 1 and a new N = 3, side by side
            panel.locator(".widget-select-multiple", has_text="save modes").locator("select").select_option(
                label="commit")
            panel.get_by_role("button", name="Run what is missing").click()
            expect(status).to_contain_text("measuring N = 3: torchrun --nproc_per_node 3", timeout=30_000)
            expect(panel.get_by_role("button", name="Stop")).to_be_enabled()
            panel.screenshot(path=SHOTS / "panel_running.png")

            expect(status).to_contain_text("timings for tiny, N = 1, 3", timeout=300_000)
            expect(title).to_contain_text("Stalls of tiny in fp32, N = 1, 3")
            rows = [r.split("\t")[:3] for r in table.first.locator("tbody tr").all_inner_texts()]
            assert rows == [["1", "commit", "2"], ["3", "commit", "2"]], rows  # N, the mode, its saves
            assert panel.locator("img").get_attribute("src") != before
            panel.screenshot(path=SHOTS / "panel_after.png")
            page.screenshot(path=SHOTS / "notebook_after.png")
        except Exception:
            page.screenshot(path=SHOTS / "failure.png", full_page=True)  # what the page showed when it failed
            raise
        finally:
            browser.close()
