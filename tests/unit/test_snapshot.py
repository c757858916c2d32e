"""Snapshot files: names that sort in the order of the changes, whatever the clock does."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import javaproperties
import pytest

from frontend.config import build_config, parse_model_snapshot
from frontend.errors import ConfigError
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


# ---- reading: a snapshot is untrusted input -------------------------------------------------

GOOD = {"name": "snapshot", "modelCount": 1,
        "models": {"echo": {"1.0": {"defaultVersion": True, "marName": "echo.mar",
                                    "minWorkers": 1, "maxWorkers": 1, "batchSize": 2}}}}
#: model_snapshot documents that are JSON but not snapshots, each with what the error names.
MALFORMED_DOCUMENTS = [
    ({"models": []}, "'models' must be an object"),
    ({"name": "snapshot"}, "'models' must be an object"),
    ({"models": {"echo": "1.0"}}, "models.echo must be an object of versions"),
    ({"models": {"echo": {}}}, "models.echo must be an object of versions"),
    ({"models": {"echo": {"1.0": "echo.mar"}}}, "models.echo.1.0 must be an object"),
    ({"models": {"echo": {"1.0": None}}}, "models.echo.1.0 must be an object"),
    ({"models": {"echo": {"1.0": {"minWorkers": 1}}}}, "models.echo.1.0.marName"),
    ({"models": {"echo": {"1.0": {"marName": 7}}}}, "models.echo.1.0.marName"),
    ({"models": {"echo": {"1.0": {"marName": " "}}}}, "models.echo.1.0.marName"),
    ({"models": {"echo": {"1.0": {"marName": "e.mar", "defaultVersion": "yes"}}}},
     "defaultVersion"),
    ({"models": {"e\ncho": {"1.0": None}}}, "models.'e\\ncho'.1.0"),
]


def _write(folder: Path, stamp: str, text: str | bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stamp}{SUFFIX}"
    if isinstance(text, str):
        text = text.encode("utf-8")
    path.write_bytes(text)
    return path


def _properties(document: object) -> str:
    return javaproperties.dumps({"model_snapshot": json.dumps(document)}, timestamp=False)


@pytest.mark.parametrize(("document", "problem"), MALFORMED_DOCUMENTS)
def test_a_malformed_snapshot_document_names_its_problem(document: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        parse_model_snapshot(json.dumps(document))


@pytest.mark.parametrize("text", [
    b"\xff\xfe not utf-8", b"model_snapshot={\"models\": ", b"nothing=here\n",
    b"model_snapshot=[1, 2]\n", b"model_snapshot=\\uZZZZ\n",
    b"model_snapshot=" + b"[" * 100_000 + b"\n", b"model_snapshot=\"models\"\n",
    *(_properties(document).encode() for document, _ in MALFORMED_DOCUMENTS),
])
def test_an_unreadable_newest_snapshot_is_skipped_for_the_next_readable_one(
        tmp_path: Path, text: bytes, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "config"
    _write(folder, "20260101000000000", _properties(GOOD))
    bad = _write(folder, "20260101000000001", text)
    assert Snapshots(folder, enabled=True).latest() == GOOD
    (line,) = [record for record in caplog.records if record.levelname == "ERROR"]
    assert str(bad) in line.getMessage() and not line.exc_info


def test_no_readable_snapshot_is_none(tmp_path: Path) -> None:
    folder = tmp_path / "config"
    _write(folder, "20260101000000000", b"\xff")
    _write(folder, "20260101000000001", _properties({"models": []}))
    assert Snapshots(folder, enabled=True).latest() is None


def test_a_model_snapshot_config_key_that_is_malformed_is_a_config_error() -> None:
    for document, problem in MALFORMED_DOCUMENTS:
        with pytest.raises(ConfigError, match=re.escape(problem)) as error:
            build_config({"model_snapshot": json.dumps(document)})
        assert "config key model_snapshot=" in str(error.value)
        assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="nested too deeply"):
        build_config({"model_snapshot": "[" * 100_000})
