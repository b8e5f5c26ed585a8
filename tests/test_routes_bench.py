"""`benchmarks/routes.py --quick`: every save and conversion route runs and has its row and every ratio its line
(figures are printed, never asserted: timings on a shared machine are noise). Not in the fast tier: five launches
and six converter processes took 2.3-5.3 minutes on the 2-core development machine under load."""

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import routes  # noqa: E402  (benchmarks/routes.py)


def test_quick_routes_table_has_every_route(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(BENCHMARKS / "routes.py"), "--quick", "--output_root", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, cwd=BENCHMARKS)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    firsts = {line.split("  ")[0] for line in done.stdout.splitlines()}
    wanted = ["floor: buffered+fsync", *(f"save: {m}" for m in routes.MODES), *routes.CONVERSIONS]
    assert [w for w in wanted if w not in firsts] == [], done.stdout
    assert "async stall / plain stall" in done.stdout and "export / zero_to_fp32.py + fsync" in done.stdout
