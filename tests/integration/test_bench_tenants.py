"""benchmarks/tenants.py's ``--smoke`` run (a real batchserve started as a user starts it, the
three phases for 0.8 s each): it runs, every phase's requests are answered, and the two models of
the device group get about half of the device each. Keeps the benchmark from rotting."""

from __future__ import annotations

import re

import pytest

from benchmarks import tenants


def test_the_smoke_run_answers_every_phase_and_shares_the_device(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert tenants.main(["--smoke"]) == 0
    rows = {tuple(cell.strip() for cell in line.split("|")[2:4]): line.split("|")
            for line in capsys.readouterr().out.splitlines() if line.startswith("| batchserve")}
    assert set(rows) == {("alone", "light"), ("overload", "light"), ("overload", "heavy"),
                         ("devices", "dev1"), ("devices", "dev2")}
    alone = rows[("alone", "light")]
    assert int(alone[5]) > 0 and alone[5] == alone[6] and alone[8].strip() == "0"  # all 200
    for model in ("dev1", "dev2"):
        metric = re.search(r"([\d.]+)% \(metric\)", rows[("devices", model)][14])
        assert metric is not None and 35.0 < float(metric.group(1)) < 65.0
