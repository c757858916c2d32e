"""benchmarks/gpu_check.sh's CPU dry run (issue 33, item 7): the script that measures a lent
GPU in one call runs here with tiny models on the CPU, through the same code (every step's
served runs against a real server, ResNet-50's made JPEGs, share_weights: cuda_ipc scaled
from one worker to two, TorchServe's step saying why it is skipped), and ends its output with
exactly one RESULT line whose served figures were measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu_result import RESULT_FIELDS, parse_result_line

ROOT = Path(__file__).resolve().parents[2]
#: The dry run's command (benchmarks/README.md gives it too).
DRY_RUN = {"DEVICE": "cpu", "TINY": "1", "SETUP": "0", "TESTS": "", "TORCHSERVE": "0",
           "STEPS": "all", "DURATION": "0.5", "WARMUP": "0.3", "TOTAL_S": "400"}


def test_the_dry_run_serves_every_step_and_ends_with_one_result_line(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, **DRY_RUN, "OUT": str(out), "PY": sys.executable,
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=450, check=False)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert lines[-1].startswith("RESULT "), done.stdout[-3000:]
    assert [line for line in lines if line.startswith("RESULT")] == [lines[-1]]
    fields = parse_result_line(lines[-1])
    assert list(fields) == ["card", *RESULT_FIELDS]
    assert fields["card"] == "cpu"
    # Measured on the CPU: every batchserve figure; no TorchServe, no GPU to be busy.
    for name in ("resnet152_bf16_img_s", "lone_p50_ms", "resnet50_jpeg_img_s"):
        assert fields[name] != "na" and float(fields[name]) > 0, (name, done.stdout[-3000:])
    assert fields["torchserve_resnet152_img_s"] == "na" and fields["gpu_busy_pct"] == "na"

    document = json.loads((out / "results.json").read_text())
    rows = document["rows"]
    assert not [row for row in rows if row.get("error")], rows
    ipc = [row for row in rows if row["variant"] == "fp32-ipc"]
    assert [row["workers"] for row in ipc] == [1, 2]
    assert all(row["statuses"] == {"200": row["statuses"].get("200", 0)} for row in rows)
    assert any("TorchServe not measured: not looked for" in note
               for note in document["notes"])
    assert any(note.startswith("resnet50 JPEGs: 6") for note in document["notes"])
    # Only this run's servers' logs are packed.
    listed = (out / "servers.txt").read_text().split()
    assert len(listed) == 1 and (out / "logs.tgz").exists()
