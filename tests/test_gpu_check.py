"""`make gpu-check` on a machine without a GPU (DS_ACCELERATOR=cpu hides any): one line, exit 0, no report written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.fast
def test_without_a_gpu_it_says_so_in_one_line_and_writes_nothing(tmp_path):
    report = tmp_path / "gpu.md"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--report", str(report),
                           "--build", str(tmp_path / "build")], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().count("\n") == 0 and "no CUDA GPU" in done.stdout
    assert not report.exists() and not (tmp_path / "build").exists()


@pytest.mark.fast
def test_the_makefile_has_the_target():
    assert "\ngpu-check: $(STAMP)\n\t$(PY) benchmarks/gpu_check.py\n" in (ROOT / "Makefile").read_text()
