"""bench/bench_wakeups.py runs each arrangement and reports a round trip (a smoke test: no timing asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wakeup_bench_reports_each_arrangement() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_wakeups.py"), "--round-trips", "50"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "both sleep, two CPUs",
        "the caller polls up to 100 us",
        "both sleep, one CPU",
    ]
    assert all(float(line.rsplit(":", 1)[1].split()[0]) > 0 for line in lines)
