"""frontend/server.py's startup model list: ``load_models`` / ``--models`` entries become
registrations (the server's lifecycle itself runs in the integration tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from frontend.config import ServerConfig
from frontend.errors import ConfigError
from frontend.models.loader import RegisterRequest
from frontend.server import startup_requests
from model_archiver.manifest import MANIFEST_PATH


def _store(tmp_path: Path) -> Path:
    store = tmp_path / "store"
    store.mkdir()
    for name in ("b.mar", "a.tar.gz", "c.tgz", "notes.txt", ".hidden.mar"):
        (store / name).write_bytes(b"")
    unpacked = store / "d"
    (unpacked / MANIFEST_PATH).parent.mkdir(parents=True)
    (unpacked / MANIFEST_PATH).write_text("{}")
    (store / "empty_dir").mkdir()
    return store


def startup(url: str, name: str | None = None) -> RegisterRequest:
    """A startup entry's registration: loaded at startup, given by the operator (so that it
    needs no allowed_urls)."""
    return RegisterRequest(url=url, model_name=name, loaded_at_startup=True,
                           given_by_operator=True)


def test_all_registers_every_archive_of_the_model_store_by_name(tmp_path: Path) -> None:
    config = ServerConfig(model_store=_store(tmp_path))
    assert startup_requests(config, ("all",)) == [
        startup(name)
        for name in ("a.tar.gz", "b.mar", "c.tgz", "d")]


def test_all_of_an_empty_store_is_nothing(tmp_path: Path) -> None:
    assert startup_requests(ServerConfig(model_store=tmp_path), ("all",)) == []


def test_all_without_a_model_store_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="model store"):
        startup_requests(ServerConfig(model_store=None), ("all",))


def test_an_archive_alone_takes_its_manifest_name() -> None:
    assert startup_requests(ServerConfig(), ("x.mar",)) == [
        startup("x.mar")]


def test_name_equals_archive_names_the_model() -> None:
    assert startup_requests(ServerConfig(), ("squeeze=x.mar", " y = y.tar.gz ")) == [
        startup("x.mar", "squeeze"),
        startup("y.tar.gz", "y")]


def test_whitespace_around_an_archive_is_dropped() -> None:
    assert startup_requests(ServerConfig(), ("  x.mar\t",)) == [
        startup("x.mar")]


def test_an_empty_name_is_no_name() -> None:
    assert startup_requests(ServerConfig(), ("=x.mar",)) == [
        startup("x.mar")]


def test_entries_keep_their_order_and_all_expands_in_place(tmp_path: Path) -> None:
    config = ServerConfig(model_store=_store(tmp_path))
    urls = [r.url for r in startup_requests(config, ("z=https://host/z.mar", "all", "b.mar"))]
    assert urls == ["https://host/z.mar", "a.tar.gz", "b.mar", "c.tgz", "d", "b.mar"]


def test_every_startup_registration_is_marked_loaded_at_startup(tmp_path: Path) -> None:
    config = ServerConfig(model_store=_store(tmp_path))
    requests = startup_requests(config, ("all", "x.mar", "n=y.mar"))
    assert all(r.loaded_at_startup for r in requests)
    assert all(r.synchronous for r in requests)  # Server makes them asynchronous itself


def test_all_with_whitespace_is_still_all(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert startup_requests(ServerConfig(model_store=store), (" all ",)) == \
        startup_requests(ServerConfig(model_store=store), ("all",))


@pytest.mark.parametrize("entry", ["x=", "x= ", " "])
def test_an_entry_without_an_archive_is_a_config_error(entry: str) -> None:
    with pytest.raises(ConfigError, match="names no archive"):
        startup_requests(ServerConfig(), (entry,))
