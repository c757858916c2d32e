"""Front processes (``number_of_netty_threads`` > 1, frontend/front/) against the real server:
the server and one front accept on the inference port (SO_REUSEPORT); the kernel spreads fresh
connections between them by their ports, so each test opens many fresh connections and counts,
from the outside, which process took them (``batchserve_front_requests_total``: what the front
sent over its link)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import requests
import yaml

from frontend.config import netty_fronts, usable_cores
from model_archiver.packaging import ArchiveOptions, build_archive
from tests.conftest import HANDLERS, RunningServer, launch_server, spawn_server

CONFIGS = {
    # Fixed batches of 8, waiting up to 5 s: 8 concurrent requests make one batch.
    "batched": {"batchSize": 8, "maxBatchDelay": 5000, "batchPolicy": "fixed"},
    "stateful": {"minWorkers": 2, "maxWorkers": 2, "batchSize": 4, "maxBatchDelay": 20,
                 "sequenceBatching": True, "sequenceMaxIdleMSec": 60000,
                 "maxNumSequence": 64, "maxSequenceJobQueueSize": 10,
                 "handler": {"cache": {"capacity": 64}}},
}
MODELS = {"echo": "echo", "batched": "batch_len", "stateful": "stateful",
          "streamer": "streamer", "sleep": "sleep"}


class Served:
    def __init__(self, server: RunningServer, keys: dict[str, str], store: Path) -> None:
        self.server = server
        self.store = store
        self.inference_key = {"Authorization": f"Bearer {keys['inference']}"}
        self.management_key = {"Authorization": f"Bearer {keys['management']}"}

    def post(self, model: str, body: bytes = b"x", **headers: str) -> requests.Response:
        """One request on a fresh connection."""
        return requests.post(f"{self.server.inference}/predictions/{model}", data=body,
                             headers={**self.inference_key, **headers, "Connection": "close"},
                             timeout=60)

    def metric(self, name: str) -> float:
        text = requests.get(f"{self.server.metrics}/metrics", timeout=30).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name))

    def linked(self) -> float:
        return self.metric("batchserve_front_requests_total")

    def access_lines(self) -> list[str]:
        path = self.store.parent / "logs" / "access_log.log"
        return path.read_text().splitlines() if path.exists() else []


def launch_fronts(root: Path, models: dict[str, str],
                  configs: dict[str, dict[str, object]] | None = None,
                  **overrides: object) -> tuple[RunningServer, dict[str, str], Path]:
    """A server and one front (token authorization on) serving ``models`` (name: fixture
    handler; ``configs``: a model's config file), built into ``root``'s model store: the
    server, its inference and management keys, its store."""
    store = root / "model_store"
    store.mkdir()
    for name, handler in models.items():
        config_file = None
        if configs and name in configs:
            config_file = root / f"{name}.yaml"
            config_file.write_text(yaml.safe_dump(configs[name]))
        build_archive(ArchiveOptions(model_name=name, version="1.0",
                                     handler=str(HANDLERS / f"{handler}.py"),
                                     export_path=store, force=True,
                                     config_file=str(config_file) if config_file else None))
    key_file = root / "key_file.json"
    server = launch_server(store, *(f"{name}.mar" for name in models),
                           frontend_processes_exact=2, disable_token_authorization=False,
                           key_file=key_file, **overrides)
    keys = json.loads(key_file.read_text())
    return server, {kind: keys[kind]["key"] for kind in ("inference", "management")}, store


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    server, keys, store = launch_fronts(tmp_path_factory.mktemp("fronts"), MODELS, CONFIGS)
    try:
        yield Served(server, keys, store)
    finally:
        server.stop()


def _fronts(served: Served) -> list[int]:
    fronts = served.server.server.fronts
    assert fronts is not None
    return fronts.pids()


def _many(served: Served, count: int, model: str = "echo") -> list[requests.Response]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda i: served.post(model, b"%d" % i), range(count)))


def test_both_processes_serve_and_each_request_is_counted_once(served: Served) -> None:
    before_total = served.metric("ts_inference_requests_total")
    before_linked, before_lines = served.linked(), len(served.access_lines())
    answers = _many(served, 60)
    assert [answer.status_code for answer in answers] == [200] * 60
    assert sorted(answer.content for answer in answers) == sorted(b"%d" % i for i in range(60))
    linked = served.linked() - before_linked
    assert 0 < linked < 60, "both processes took connections"
    assert served.metric("ts_inference_requests_total") - before_total == 60
    # The access log: one well-formed line per request, whichever process took it.
    # (the test's own /metrics requests have lines too: the predictions' are waited for)

    def predictions() -> list[str]:
        return [line for line in served.access_lines()[before_lines:]
                if "/predictions/echo" in line]

    served.server.wait_for(lambda: len(predictions()) >= 60, "the predictions' access lines")
    lines = predictions()
    assert len(lines) == 60
    assert all(re.search(r"/127\.0\.0\.1:\d+ \"POST /predictions/echo HTTP/1\.1\" 200 ", line)
               for line in lines), lines[:3]


def test_a_batch_mixes_requests_from_both_processes(served: Served) -> None:
    for _ in range(5):  # the kernel may give all 8 connections to one process: try again
        before = served.linked()
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: served.post("batched"), range(8)))
        assert [answer.text for answer in answers] == ["8"] * 8, "one batch of all 8"
        if 0 < served.linked() - before < 8:
            return
    raise AssertionError("8 fresh connections never reached both processes")


def test_tokens_are_checked_on_every_process(served: Served) -> None:
    before = served.linked()
    with ThreadPoolExecutor(8) as pool:
        refused = list(pool.map(lambda i: requests.post(
            f"{served.server.inference}/predictions/echo", data=b"x", timeout=30,
            headers={"Authorization": "Bearer wrong", "Connection": "close"}), range(30)))
    assert {answer.status_code for answer in refused} == {401}
    assert served.linked() > before
    assert {answer.status_code for answer in _many(served, 30)} == {200}


def test_a_registration_is_seen_at_once_by_fresh_connections(served: Served) -> None:
    registered = requests.post(
        f"{served.server.management}/models?url=echo.mar&model_name=late&initial_workers=1"
        "&synchronous=true", headers=served.management_key, timeout=60)
    assert registered.status_code == 200, registered.text
    try:
        before = served.linked()
        answers = [served.post("late", b"%d" % i) for i in range(50)]
        assert [answer.status_code for answer in answers] == [200] * 50
        assert served.linked() > before
    finally:
        requests.delete(f"{served.server.management}/models/late",
                        headers=served.management_key, timeout=60)
    gone = [served.post("late").status_code for _ in range(20)]
    assert gone == [404] * 20


def test_a_sequence_stays_on_its_worker_across_processes(served: Served) -> None:
    before = served.linked()
    for index in range(3):
        sequence, total, pids = f"seq-{index}", 0, set()
        for value in range(1, 9):
            answer = served.post("stateful", str(value).encode(),
                                 ts_request_sequence_id=sequence)
            assert answer.status_code == 200, answer.text
            total += value
            assert int(answer.text) == total
            pids.add(answer.headers["x-worker-pid"])
        assert len(pids) == 1, f"{sequence} ran on {pids}"
    assert served.linked() > before


def test_streams_deadlines_and_hang_ups_through_a_front(served: Served) -> None:
    before = served.linked()
    for _ in range(12):
        answer = served.post("streamer", b"hi")
        assert answer.status_code == 200
        assert answer.headers.get("transfer-encoding") == "chunked"
        assert answer.text == "hi part 1\nhi part 2\nhi part 3\n"
        late = served.post("sleep", b"2", **{"X-Request-Timeout": "0.2"})
        assert late.status_code == 504, late.text
    assert served.linked() > before
    # Clients that hang up: their jobs are dropped (never answered), others go on.
    for _ in range(8):
        with socket.create_connection(_address(served)) as sock:
            sock.sendall(_request("sleep", b"0.3", served))
    assert {answer.status_code for answer in _many(served, 10)} == {200}


def _address(served: Served) -> tuple[str, int]:
    host, port = served.server.inference.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _request(model: str, body: bytes, served: Served, method: bytes = b"POST") -> bytes:
    key = served.inference_key["Authorization"].encode()
    return (b"%s /predictions/%s HTTP/1.1\r\nhost: x\r\nauthorization: %s\r\n"
            b"content-length: %d\r\n\r\n%s" % (method, model.encode(), key, len(body), body))


def test_other_routes_and_pipelined_requests_are_spliced_to_the_owner(served: Served) -> None:
    before = served.linked()
    for _ in range(16):
        ping = requests.get(f"{served.server.inference}/ping", timeout=30,
                            headers={"Connection": "close"})
        assert ping.status_code == 200 and ping.json() == {"status": "Healthy"}
        # A prediction, then a ping and a prediction pipelined in the same write.
        with socket.create_connection(_address(served)) as sock:
            sock.sendall(_request("echo", b"one", served) + b"GET /ping HTTP/1.1\r\nhost: x\r\n\r\n"
                         + _request("echo", b"two", served))
            received = b""
            deadline = time.monotonic() + 30
            while not received.endswith(b"two") and time.monotonic() < deadline:
                received += sock.recv(65536)
        first, ping_at, second = (received.find(b"one"), received.find(b"Healthy"),
                                  received.find(b"two"))
        assert received.count(b"HTTP/1.1 200") == 3 and 0 < first < ping_at < second, \
            received.replace(b"\r\n", b"|")
    assert served.linked() > before


def test_a_killed_front_is_replaced_while_the_server_serves(served: Served) -> None:
    [old] = _fronts(served)
    os.kill(old, signal.SIGKILL)
    served.server.wait_for(lambda: _fronts(served) not in ([], [old]), "a new front process")
    assert {answer.status_code for answer in _many(served, 20)} == {200}
    # The new front links up and serves.
    before = served.linked()
    served.server.wait_for(lambda: served.post("echo").status_code == 200
                           and served.linked() > before, "the new front serving")
    assert old not in _fronts(served)


def test_one_process_starts_no_front_and_shares_no_port(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar", number_of_netty_threads=1)
    assert server.server.fronts is None
    host, port = server.inference.removeprefix("http://").rsplit(":", 1)
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    with other, pytest.raises(OSError):
        other.bind((host, int(port)))  # the listener set no SO_REUSEPORT


def test_netty_threads_run_the_processes_the_cores_can_feed(
        build_mar, start_server, caplog: pytest.LogCaptureFixture) -> None:
    """TorchServe's key counts threads: KServe's config asks for 4, which runs 4 processes
    only where there are 8 cores, and says so where it runs fewer."""
    build_mar("echo", "echo")
    expected = netty_fronts(4)
    with caplog.at_level(logging.INFO, logger="frontend.server"):
        server = start_server("echo.mar", number_of_netty_threads=4)
    fronts = server.server.fronts
    running = fronts.count if fronts is not None else 1
    assert running == expected == min(4, max(1, usable_cores() // 2))
    said = [record.getMessage() for record in caplog.records
            if "number_of_netty_threads=4" in record.getMessage()]
    if expected < 4:
        assert said and f"{expected} process(es) accept" in said[0], said
    else:
        assert not said
    assert server.predict("echo", b"x").content == b"x"


def test_sigterm_stops_every_process(tmp_path: Path, build_mar, model_store: Path) -> None:
    build_mar("echo", "echo")
    work = tmp_path / "work"
    work.mkdir()
    server = spawn_server(work, model_store, "echo=echo.mar",
                          config={"frontend_processes": 3})
    try:
        owner = psutil.Process(server.process.pid)
        fronts = [child for child in owner.children(recursive=True)
                  if "frontend.front" in " ".join(child.cmdline())]
        deadline = time.monotonic() + 30
        while len(fronts) < 2 and time.monotonic() < deadline:
            fronts = [child for child in owner.children(recursive=True)
                      if "frontend.front" in " ".join(child.cmdline())]
        assert len(fronts) == 2
        everyone = owner.children(recursive=True)
        answer = requests.post(f"{server.inference}/predictions/echo", data=b"x", timeout=30)
        assert answer.status_code == 200
    finally:
        status = server.stop()
    assert status == 0
    _, alive = psutil.wait_procs(everyone, timeout=30)
    assert not alive, alive
