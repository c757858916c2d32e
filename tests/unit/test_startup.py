"""The startup models' archives the early fork server reads (frontend/models/startup.py)."""

from __future__ import annotations

from pathlib import Path

from frontend.config import ServerConfig
from frontend.models.startup import startup_archives


def test_startup_archives_are_found_as_registration_finds_them(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    (store / "a.mar").write_bytes(b"zip")
    (store / "folder" / "MAR-INF").mkdir(parents=True)
    (store / "folder" / "MAR-INF" / "MANIFEST.json").write_text("{}")
    elsewhere = tmp_path / "b.mar"
    elsewhere.write_bytes(b"zip")
    config = ServerConfig(model_store=store, load_models=(
        "a.mar", "f=folder", str(elsewhere), f"file://{elsewhere}", "missing.mar",
        "http://127.0.0.1:9/c.mar", f"{tmp_path}/../b.mar"))
    assert startup_archives(config) == [store / "a.mar", store / "folder", elsewhere,
                                        elsewhere]
    everything = ServerConfig(model_store=store, load_models=("all",))
    assert sorted(startup_archives(everything)) == [store / "a.mar", store / "folder"]
    assert startup_archives(ServerConfig(load_models=("a.mar",))) == []
