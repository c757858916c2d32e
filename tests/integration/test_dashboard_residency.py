"""The live page's residency over time (issue 36) against a real server that keeps at most one
of its two models loaded (``max_loaded_models=1``): requests to each in turn page it in and
the other out; the page's data holds each model's state in each second and its last use, and
the page in a real browser (headless Chromium) draws each model's strip in both states and
shows them in its table."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import requests

from model_archiver.packaging import ArchiveOptions, build_archive
from tests.conftest import HANDLERS, ServerProcess, spawn_server
from tests.integration.browser import Browser
from tests.integration.residency_feature import needs_residency

MODELS = ("left", "right")


def _data(server: ServerProcess) -> dict[str, Any]:
    answer = requests.get(f"{server.management}/dashboard/data", timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def _sampled(server: ServerProcess, loaded: str, timeout_s: float = 30) -> dict[str, Any]:
    """The data once its last sample has ``loaded`` loaded and the other model paged out."""
    deadline = time.monotonic() + timeout_s
    while True:
        document = _data(server)
        if document["samples"]:
            states = {row["model"]: row["residency"] for row in document["samples"][-1]["models"]}
            if states == {name: "loaded" if name == loaded else "paged_out" for name in MODELS}:
                return document
        if time.monotonic() > deadline:
            raise AssertionError(f"no sample with only {loaded} loaded: {document}")
        time.sleep(0.1)


@needs_residency
def test_the_page_plots_each_model_paged_in_and_out_over_time(tmp_path: Path) -> None:
    store = tmp_path / "model_store"
    store.mkdir()
    for name in MODELS:
        build_archive(ArchiveOptions(model_name=name, version="1.0",
                                     handler=str(HANDLERS / "echo.py"), export_path=store,
                                     force=True))
    work = tmp_path / "server"
    work.mkdir()
    server = spawn_server(work, store, *(f"{name}={name}.mar" for name in MODELS),
                          config={"max_loaded_models": 1})
    try:
        for name in ("right", "left", "right"):
            answer = requests.post(f"{server.inference}/predictions/{name}", data=b"hi",
                                   timeout=60)
            assert answer.status_code == 200 and answer.content == b"hi", answer.text
            document = _sampled(server, loaded=name)
        history = {name: {row["residency"] for sample in document["samples"]
                          for row in sample["models"] if row["model"] == name}
                   for name in MODELS}
        assert history == {"left": {"loaded", "paged_out"}, "right": {"loaded", "paged_out"}}
        now = {model["model"]: model for model in document["models"]}
        assert now["right"]["residency"] == "loaded" and now["left"]["residency"] == "paged_out"
        # Both were used, the right one last.
        assert 0 < now["left"]["lastUsed"] <= now["right"]["lastUsed"] <= document["now"]

        with Browser(tmp_path) as browser:
            browser.open(f"{server.management}/dashboard")
            browser.wait_for("Number(document.getElementById('c-residency').dataset.points"
                             " || 0) >= 4", "the residency strips to draw")
            assert browser.evaluate("[...new Set([...document.querySelectorAll("
                                    "'#c-residency rect[data-residency]')].map("
                                    "(r) => r.dataset.residency))].sort()") == [
                "loaded", "paged_out"]
            assert browser.evaluate("[...document.querySelectorAll('#models tbody tr')].map("
                                    "(tr) => tr.children[0].textContent + ' ' + "
                                    "tr.children[15].textContent)") == [
                "left paged out", "right loaded"]
            assert "now 1 of 2 loaded" in browser.evaluate(
                "document.getElementById('c-residency').textContent")
    finally:
        server.stop()
