"""The live page (``GET /dashboard`` on the management port) against one real server, started
as a user starts it (``torchserve --start --foreground``) with token authorization on, and
kept under load by a few client threads for the whole module (bounded in requests and time):

- its data (``/dashboard/data``): refused without the management key, and with it the model,
  its workers (and how each runs its batches: padded to buckets 1, 2, 4, as its handler
  reports) and a per-second history whose numbers match the load (requests, latency, batch
  sizes, utilisation, bucket hits and padding);
- the page in a real browser (headless Chromium, tests/integration/browser.py): it takes the
  key from its URL's fragment (or its form), draws its plots (the page counts the points it
  drew; a screenshot shows coloured lines in each plot area), and escapes what it shows.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
from PIL import Image

from model_archiver.packaging import ArchiveOptions, build_archive
from tests.conftest import HANDLERS, ServerProcess, spawn_server
from tests.integration.browser import Browser

MODEL = "sleepy"
BATCH_SIZE = 4
BUCKETS = (1, 2, 4)
#: What each request asks the sleep handler to sleep (the largest of a batch's).
SLEEP_S = 0.02
#: The load, bounded: at most this many requests, for at most this long.
MAX_REQUESTS = 20_000
MAX_LOAD_S = 120.0
CLIENTS = 6


@dataclass
class Load:
    """Client threads sending predictions until stopped, the deadline or the request cap."""

    url: str
    headers: dict[str, str]
    stop: threading.Event = field(default_factory=threading.Event)
    sent: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        deadline = time.monotonic() + MAX_LOAD_S

        def client() -> None:
            with requests.Session() as session:
                while not self.stop.is_set() and time.monotonic() < deadline:
                    with self.lock:
                        if self.sent >= MAX_REQUESTS:
                            return
                        self.sent += 1
                    try:
                        status = session.post(self.url, data=str(SLEEP_S).encode(),
                                              headers=self.headers, timeout=30).status_code
                    except requests.RequestException:
                        status = 0
                    with self.lock:
                        self.statuses[status] = self.statuses.get(status, 0) + 1

        self.threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)


@dataclass
class Served:
    server: ServerProcess
    keys: dict[str, str]
    load: Load

    def auth(self, kind: str = "management") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[kind]}"}

    def data(self, **params: Any) -> dict[str, Any]:
        answer = requests.get(f"{self.server.management}/dashboard/data", params=params,
                              headers=self.auth(), timeout=30)
        assert answer.status_code == 200, answer.text
        return answer.json()  # type: ignore[no-any-return]


def start_served(root: Path) -> tuple[ServerProcess, dict[str, str]]:
    """The page's server (also the screenshot's, tests/integration/dashboard_screenshot.py):
    the ``bucketed`` handler (it sleeps what each request asks, and says it pads its batches
    to buckets 1, 2, 4), batch size 4, two workers, token authorization on; its keys by kind
    (inference, management)."""
    store = root / "model_store"
    store.mkdir()
    model_config = root / "model-config.yaml"
    model_config.write_text(f"batchSize: {BATCH_SIZE}\nmaxBatchDelay: 20\n"
                            f"handler:\n  toy_execution:\n    batch_buckets: {list(BUCKETS)}\n")
    build_archive(ArchiveOptions(model_name=MODEL, version="1.0",
                                 handler=str(HANDLERS / "bucketed.py"), export_path=store,
                                 force=True, config_file=str(model_config)))
    work = root / "server"
    work.mkdir()
    # No --disable-token-auth: token authorization is on, as TorchServe 0.11+ starts.
    server = spawn_server(work, store, f"{MODEL}={MODEL}.mar",
                          config={"default_workers_per_model": 2}, flags=())
    try:
        keys = json.loads((work / "key_file.json").read_text())
    except BaseException:
        server.stop()
        raise
    return server, {kind: keys[kind]["key"] for kind in ("inference", "management")}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    server, keys = start_served(tmp_path_factory.mktemp("dashboard"))
    try:
        load = Load(f"{server.inference}/predictions/{MODEL}",
                    {"Authorization": f"Bearer {keys['inference']}"})
        load.start()
        try:
            yield Served(server, keys, load)
        finally:
            load.finish()
        # The load was answered: every request it sent got 200.
        assert set(load.statuses) == {200}, load.statuses
        assert keys["management"] not in server.log_text()
    finally:
        server.stop()


def _latest_busy_row(served: Served, timeout_s: float = 60) -> tuple[dict[str, Any],
                                                                     dict[str, Any]]:
    """The data once a sample shows the model serving (requests, batches, busy workers)."""
    deadline = time.monotonic() + timeout_s
    while True:
        document = served.data()
        rows = [row for sample in document["samples"] for row in sample["models"]
                if row["model"] == MODEL and row.get("requests") and row.get("meanBatch")
                and row.get("utilisation") and row.get("latencyMs")]
        if rows:
            return document, rows[-1]
        if time.monotonic() > deadline:
            raise AssertionError(f"no sample of {MODEL} under load: {document}")
        time.sleep(0.2)


def test_the_page_loads_without_a_key_but_its_data_needs_the_management_key(
        served: Served) -> None:
    management = served.server.management
    page = requests.get(f"{management}/dashboard", timeout=30)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    policy = page.headers["Content-Security-Policy"]
    assert "script-src 'sha256-" in policy and "connect-src 'self'" in policy
    assert all(key not in page.text for key in served.keys.values())
    for headers in ({}, served.auth("inference"), {"Authorization": "Bearer not-the-key"}):
        refused = requests.get(f"{management}/dashboard/data", headers=headers, timeout=30)
        assert refused.status_code == 401, headers
        assert refused.json()["code"] == 401
        assert "samples" not in refused.text
    assert requests.get(f"{management}/dashboard/data", headers=served.auth(),
                        timeout=30).status_code == 200


def test_the_data_shows_the_model_its_workers_and_its_history_under_load(
        served: Served) -> None:
    document, row = _latest_busy_row(served)
    assert document["intervalS"] == 1.0 and document["windowS"] >= 60
    (model,) = document["models"]
    assert model["model"] == MODEL and model["version"] == "1.0"
    assert model["batchSize"] == BATCH_SIZE and model["policy"] == "adaptive"
    assert [worker["state"] for worker in model["workers"]] == ["READY", "READY"]
    assert all(worker["pid"] > 0 for worker in model["workers"])
    assert [worker["execution"] for worker in model["workers"]] == [
        {"mode": "padded", "batchBuckets": list(BUCKETS), "fallbackReason": "",
         "graphPoolBytes": 0}] * 2
    buckets = model["buckets"]
    assert buckets["sizes"] == list(BUCKETS) and buckets["batches"] >= 1
    # Only a batch of 3 is padded (to 4): a row each.
    assert buckets["paddedRows"] == buckets["batches"] - buckets["hits"]
    sizes = model["recentBatchSizes"]
    assert sizes and max(sizes) <= BATCH_SIZE
    # Six clients, two workers: batches carry more than one request.
    assert max(sizes) > 1
    # The numbers match the load: each request takes at least the handler's sleep (20 ms; the
    # percentiles are estimated within the histogram's buckets: 10-25 ms holds 20 ms).
    latency = row["latencyMs"]
    assert 10 <= latency["p50"] <= latency["p90"] <= latency["p99"]
    assert 1 <= row["meanBatch"] <= BATCH_SIZE
    assert 0 < row["utilisation"] <= 1
    assert set(row["busy"]) == {worker["id"] for worker in model["workers"]}
    assert row["workersUp"] == 2 and row["refused"] == 0
    # No residency limits: the model is loaded in every second, and now.
    assert model["residency"] == "loaded"
    assert {row["residency"] for sample in document["samples"] for row in sample["models"]} == {
        "loaded"}
    times = [sample["t"] for sample in document["samples"]]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert all(0 <= sample["cpu"] <= 100 for sample in document["samples"]
               if sample["cpu"] is not None)
    # ?since= returns only what is newer: what the page asks for after its first poll.
    newer = served.data(since=times[-1])["samples"]
    assert all(sample["t"] > times[-1] for sample in newer)


#: Each plot's points, the page's state and how many polls it has done.
_PAGE_STATE = """(() => {
  const points = {};
  for (const svg of document.querySelectorAll("svg")) {
    points[svg.id] = Number(svg.dataset.points || 0);
  }
  return {points, polls: Number(document.body.dataset.polls), state: document.body.dataset.state};
})()"""
#: The plots the load draws now (those of the request phases, batch fill and dispatch reasons
#: draw once the server keeps those families; until then they say so).
_DRAWN = ("c-requests", "c-queue", "c-latency", "c-batch", "c-sizes", "c-buckets",
          "c-workers", "c-host", "c-residency")
_MAYBE = ("c-phases", "c-reasons", "c-fill")


def _coloured_pixels(image: Image.Image, box: dict[str, float]) -> int:
    """Pixels of a plot's drawing area (below its legend, inside its axes) in a colour, not
    the white, greys and black of the background, grid and labels."""
    left = box["x"] + box["width"] * 46 / 560
    right = box["x"] + box["width"] * (1 - 8 / 560)
    top = box["y"] + box["height"] * 15 / 190  # the legend ends at 13, the axes start at 18
    bottom = box["y"] + box["height"] * 172 / 190  # a line at zero included
    area = image.convert("RGB").crop((round(left), round(top), round(right), round(bottom)))
    # Saturation above 100 of 255: the plots' colours; the greys of labels and grid are below 60.
    return sum(area.convert("HSV").getchannel("S").histogram()[101:])


def test_the_page_draws_its_plots_in_a_browser_with_token_auth(served: Served,
                                                               tmp_path: Path) -> None:
    management = served.server.management
    with Browser(tmp_path) as browser:
        # The key in the fragment: never sent to the server; the page removes it.
        browser.open(f"{management}/dashboard#token={served.keys['management']}")
        # Each line plot with a few seconds of history (the bars: one size at least).
        wanted = " && ".join(f's.points["{plot}"] >= {1 if plot == "c-sizes" else 3}'
                             for plot in _DRAWN)
        page = browser.wait_for(
            f"(() => {{ const s = {_PAGE_STATE}; return s.polls >= 3 && {wanted} ? s : null; }})()",
            "every plot to draw under load")
        assert page["state"] == "ok"
        assert browser.evaluate("location.href") == f"{management}/dashboard"
        assert browser.evaluate(
            "document.querySelector('#models tbody td').textContent") == MODEL
        assert browser.evaluate("document.querySelectorAll('#workers tbody tr').length") == 2
        # Each worker's execution, and the model's buckets, in the tables.
        assert browser.evaluate("[...document.querySelectorAll('#workers tbody tr')].map("
                                "(tr) => tr.children[7].textContent + ' ' + "
                                "tr.children[8].textContent)") == ["padded 1, 2, 4"] * 2
        assert browser.evaluate(
            "document.querySelector('#models tbody tr').children[12].textContent") == "1, 2, 4"
        # Its residency: loaded (no limits), in the table and in every second of its strip.
        assert browser.evaluate(
            "document.querySelector('#models tbody tr').children[15].textContent") == "loaded"
        assert browser.evaluate("[...new Set([...document.querySelectorAll("
                                "'#c-residency rect[data-residency]')].map("
                                "(r) => r.dataset.residency))]") == ["loaded"]
        for plot in _MAYBE:
            if not page["points"][plot]:
                assert "no data yet" in browser.evaluate(
                    f"document.getElementById('{plot}').textContent"), plot
        boxes = browser.evaluate("""Object.fromEntries([...document.querySelectorAll("svg")]
            .map((svg) => {
              const r = svg.getBoundingClientRect();
              return [svg.id, {x: r.x, y: r.y, width: r.width, height: r.height}];
            }))""")
        shot = Image.open(browser.screenshot(tmp_path / "dashboard.png"))
        for plot in _DRAWN:
            assert boxes[plot]["height"] > 50, (plot, boxes[plot])
            # A few seconds of a 5-minute axis are a few pixels wide: blank is 0 (below).
            assert _coloured_pixels(shot, boxes[plot]) >= 5, f"{plot} looks blank"
        # An empty plot has no coloured pixels (the check above can fail); one of those the
        # server keeps once issue 26's timing and reasons are in draws as the others do.
        for plot in _MAYBE:
            if page["points"][plot]:
                assert _coloured_pixels(shot, boxes[plot]) >= 5, f"{plot} looks blank"
            else:
                assert _coloured_pixels(shot, boxes[plot]) == 0, plot

        # Without a key in the URL, the page asks for it; the form's key is used.
        browser.open(f"{management}/dashboard")
        browser.wait_for("document.body.dataset.state === 'auth'", "the page to ask for a key")
        browser.evaluate(f"""(() => {{
            document.getElementById("key").value = {json.dumps(served.keys["management"])};
            document.getElementById("login").requestSubmit(); }})()""")
        browser.wait_for("document.body.dataset.state === 'ok' && "
                         "Number(document.body.dataset.points) > 0", "the page to draw")
        assert browser.evaluate("document.getElementById('key').value") == ""
