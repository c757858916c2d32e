"""A forked worker imports what a fresh worker of its archive would (docs/workers.md), against
the real server: archives that ship their own ``PIL`` (an installed package), ``colorsys``,
``zipfile`` and ``json`` (standard modules; the fork server imports ``zipfile`` for itself, and
the worker itself imports ``json`` before any archive's folder joins ``sys.path``, so a fresh
worker keeps the standard one) and each their own ``helper``, while the fork server imports
Pillow, and ``colorsys`` (``fork_preload``), for other models.

Each archive's handler (tests/fixtures/forkserver/shadowing/report.py) answers where its
imports come from; a forked worker's answer must be its ``workerStart: spawn`` twin's, at first,
after a SIGKILL and its restart, and after a scale-up.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from model_archiver.packaging import ArchiveOptions, build_archive
from tests.conftest import ROOT, RunningServer, launch_server

FIXTURES = ROOT / "tests" / "fixtures" / "forkserver"
SHADOWING = FIXTURES / "shadowing"
#: What a fresh worker of the ``shadows`` archive sees: its own PIL, colorsys and helper, and
#: the standard json, which the worker imported before the archive's folder joined sys.path.
OWN = {"PIL": "archive shadows", "colorsys": "archive shadows", "zipfile": "archive shadows",
       "helper": "archive shadows", "helper imported by the handler": "archive shadows"}


def _archive(store: Path, name: str, files: str, config: dict[str, Any] | None = None) -> None:
    config_file = None
    if config is not None:
        config_file = store.parent / f"{name}.yaml"
        config_file.write_text(yaml.safe_dump(config))
    build_archive(ArchiveOptions(model_name=name, handler=str(SHADOWING / "report.py"),
                                 extra_files=(str(SHADOWING / files),), export_path=store,
                                 force=True,
                                 config_file=str(config_file) if config_file else None))


def _store(root: Path) -> Path:
    store = root / "model_store"
    store.mkdir()
    _archive(store, "shadows", "shadows")
    _archive(store, "shadows-fresh", "shadows", {"workerStart": "spawn"})
    _archive(store, "neighbour", "neighbour")
    build_archive(ArchiveOptions(model_name="pillow", handler=str(SHADOWING / "pillow.py"),
                                 export_path=store, force=True))
    return store


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    store = _store(tmp_path_factory.mktemp("shadowing"))
    # The fork server imports the standard colorsys for whatever models want it.
    running = launch_server(store, "shadows=shadows.mar", "shadows-fresh=shadows-fresh.mar",
                            "neighbour=neighbour.mar", fork_preload=("colorsys",))
    try:
        yield running
    finally:
        running.stop()


def _workers(server: RunningServer, model: str) -> list[dict[str, Any]]:
    return list(server.describe(model)["workers"])  # type: ignore[call-overload]


def _answer(server: RunningServer, model: str) -> dict[str, Any]:
    reply = server.predict(model, b"where from?")
    assert reply.status_code == 200, reply.text
    return json.loads(reply.text)  # type: ignore[no-any-return]


def _answers(server: RunningServer, model: str) -> dict[int, dict[str, Any]]:
    """One answer from each of ``model``'s workers, by pid (requests until every worker has
    answered one, bounded)."""
    pids = {int(worker["pid"]) for worker in _workers(server, model)}
    answers: dict[int, dict[str, Any]] = {}
    for _ in range(50 * len(pids)):
        answer = _answer(server, model)
        answers[answer.pop("pid")] = answer
        if pids <= set(answers):
            return {pid: answers[pid] for pid in pids}
    raise AssertionError(f"workers {sorted(pids - set(answers))} of {model} never answered")


def _as_fresh(server: RunningServer) -> dict[str, Any]:
    [fresh] = _answers(server, "shadows-fresh").values()
    assert {name: fresh[name] for name in OWN} == OWN
    assert fresh["json"] == f"file {json.__file__}"
    return fresh


def _assert_forked_as_fresh(server: RunningServer, workers: int) -> None:
    fresh = _as_fresh(server)
    described = _workers(server, "shadows")
    assert [worker["startMode"] for worker in described] == ["forked"] * workers, described
    answers = _answers(server, "shadows")
    assert len(answers) == workers
    for answer in answers.values():
        assert answer == fresh


def test_a_forked_worker_imports_its_archives_own_modules_as_a_fresh_one_does(
        server: RunningServer) -> None:
    # colorsys was imported by the fork server (fork_preload) before it forked this worker.
    _assert_forked_as_fresh(server, 1)
    [fresh] = _workers(server, "shadows-fresh")
    assert fresh["startMode"] == "fresh"
    # Its neighbour imports its own helper, and the installed or standard rest.
    [neighbour] = _workers(server, "neighbour")
    assert neighbour["startMode"] == "forked"
    answer = _answer(server, "neighbour")
    assert answer["helper"] == answer["helper imported by the handler"] == "archive neighbour"
    for name in ("PIL", "colorsys", "zipfile"):
        assert answer[name].startswith("file "), answer


def test_after_another_model_imported_pillow_a_restarted_and_a_scaled_up_worker_still_do(
        server: RunningServer) -> None:
    # Another model's handler imports Pillow: so does the fork server, before forking it.
    registered = requests.post(f"{server.management}/models", params={
        "url": "pillow.mar", "initial_workers": 1, "synchronous": "true"}, timeout=120)
    assert registered.status_code == 200, registered.text
    assert server.predict("pillow").status_code == 200
    [worker] = _workers(server, "shadows")
    os.kill(worker["pid"], signal.SIGKILL)

    def replaced() -> bool:
        [now] = _workers(server, "shadows")
        return now["status"] == "READY" and now["pid"] not in (worker["pid"], -1)

    server.wait_for(replaced, "the killed worker to be replaced", timeout_s=60)
    _assert_forked_as_fresh(server, 1)
    scaled = requests.put(f"{server.management}/models/shadows",
                          params={"min_worker": 2, "synchronous": "true"}, timeout=120)
    assert scaled.status_code == 200, scaled.text
    _assert_forked_as_fresh(server, 2)
    # And the neighbour, forked again, still imports its own helper.
    scaled = requests.put(f"{server.management}/models/neighbour",
                          params={"min_worker": 2, "synchronous": "true"}, timeout=120)
    assert scaled.status_code == 200, scaled.text
    for answer in _answers(server, "neighbour").values():
        assert answer["helper"] == "archive neighbour"
        assert answer["PIL"].startswith("file ")


def test_an_archive_that_shadows_what_a_preloaded_module_holds_gets_fresh_workers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    # pil_user (fork_preload) holds Pillow's Image module, as torchvision's modules do: no
    # forked worker of an archive with its own PIL could import what a fresh one imports
    # (pil_user, imported again, would get the archive's PIL), so its workers start fresh.
    caplog.set_level(logging.INFO, logger="frontend.serving.workers")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(FIXTURES), *filter(None, [os.environ.get("PYTHONPATH")])]))
    store = _store(tmp_path)
    server = launch_server(store, "shadows=shadows.mar", "shadows-fresh=shadows-fresh.mar",
                           "neighbour=neighbour.mar", fork_preload=("pil_user",))
    try:
        [worker] = _workers(server, "shadows")
        assert worker["startMode"] == "fresh"
        [answer] = _answers(server, "shadows").values()
        assert answer == _as_fresh(server)
        assert "starts as a fresh interpreter: its archive shadows PIL, which pil_user " \
            "holds" in caplog.text
        # An archive that shadows nothing the fork server imported is still forked.
        [neighbour] = _workers(server, "neighbour")
        assert neighbour["startMode"] == "forked"
    finally:
        server.stop()
