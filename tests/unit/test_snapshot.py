"""Snapshot files: names that sort in the order of the changes, whatever the clock does."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from frontend.models.registry import ModelRegistry
from frontend.models.snapshot import SUFFIX, Snapshots


def test_saves_in_one_millisecond_get_names_in_order(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time_ns", lambda: 1_700_000_000_123_456_789)  # a frozen clock
    snapshots = Snapshots(tmp_path, enabled=True)
    paths = [snapshots.save(ModelRegistry()) for _ in range(3)]
    names = [path.name for path in paths if path is not None]
    assert names == sorted(names) and len(set(names)) == 3
    assert names[0] == f"20231114221320123{SUFFIX}"  # TorchServe's yyyyMMddHHmmssSSS, in UTC
    assert names[1] == f"20231114221320124{SUFFIX}"


def test_a_clock_behind_the_newest_snapshot_still_writes_a_later_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    newest = tmp_path / f"20990101000000000{SUFFIX}"  # written while the clock ran ahead
    newest.write_text("model_snapshot={}\n")
    snapshots = Snapshots(tmp_path, enabled=True)
    path = snapshots.save(ModelRegistry())
    assert path is not None and path.name == f"20990101000000001{SUFFIX}"
    latest = snapshots.latest()  # the new one, not the (empty) one written ahead of it
    assert latest is not None and latest["modelCount"] == 0 and latest["models"] == {}
    assert sorted(tmp_path.glob(f"*{SUFFIX}"))[-1] == path


def test_a_disabled_store_writes_nothing(tmp_path: Path) -> None:
    assert Snapshots(tmp_path / "config", enabled=False).save(ModelRegistry()) is None
    assert not (tmp_path / "config").exists()
