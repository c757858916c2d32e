"""The frontend-processes benchmark (benchmarks/fronts.py) run whole in its smoke mode against
real servers (batchserve with frontend_processes 1 and 2; TorchServe skipped), so that it
cannot rot: every configuration and load is measured with wrk, answered without errors, its
CPU counted, and every server it started is gone afterwards."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import gone

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("wrk") is None,
                                reason="needs wrk (make test installs it: apt-get install wrk)")


def test_the_smoke_run_measures_every_configuration_and_load(tmp_path: Path) -> None:
    out = tmp_path / "fronts.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.fronts", "--smoke",
                           "--no-torchserve", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert sorted((row["config"], row["load"]) for row in rows) == [
        ("batchserve N=1", "echo"), ("batchserve N=1", "upload"),
        ("batchserve N=2", "echo"), ("batchserve N=2", "upload")]
    for row in rows:
        assert row["errors"] == 0 and row["requests"] > 10, row
        assert 0 < row["p50_ms"] <= row["p99_ms"], row
        assert row["cpu_s"] > 0 and row["cpu_per_1000"] > 0, row
    for load in ("echo", "upload"):
        assert f"**{load}**" in done.stdout
    assert done.stdout.count("| batchserve N=1 | ") == 2
    assert "1 shuffled rounds of 1 s" in done.stdout
    for pid in {row["pid"] for row in rows}:  # each server stopped, its processes gone
        assert gone(pid), pid
