"""Faults: every request gets exactly one answer, workers come back, the server stays up."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.conftest import RunningServer, gone


def _worker(server: RunningServer, model: str) -> dict[str, object]:
    return server.describe(model)["workers"][0]  # type: ignore[index, no-any-return]


def _ready_with_new_pid(server: RunningServer, model: str, old_pid: int) -> bool:
    worker = _worker(server, model)
    return worker["status"] == "READY" and worker["pid"] not in (old_pid, -1)


def _register_one_worker(server: RunningServer, model: str, response_timeout_s: int) -> int:
    """Register ``model``.mar with one worker and this response timeout; the worker's pid."""
    requests.post(f"{server.management}/models",
                  params={"url": f"{model}.mar", "response_timeout": response_timeout_s,
                          "initial_workers": 1, "synchronous": "true"},
                  timeout=60).raise_for_status()
    return int(_worker(server, model)["pid"])  # type: ignore[call-overload]


def test_kill_9_fails_the_batch_in_flight_fast_and_the_worker_comes_back(
        build_mar, start_server, tmp_path: Path) -> None:
    build_mar("gate", "gate")
    server = start_server("gate.mar")
    pid = int(_worker(server, "gate")["pid"])  # type: ignore[call-overload]
    gate = tmp_path / "open"
    with ThreadPoolExecutor(2) as pool:
        held, queued = server.hold_gate(pool, gate, queued=1)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        answer = held.result(timeout=10)
        assert time.monotonic() - killed_at < 1.0
        assert answer.status_code == 500
        message = answer.json()["message"]
        assert "Worker died" in message and str(pid) in message
        gate.touch()  # the queued request is served by the restarted worker
        assert queued.result(timeout=60).status_code == 200
    server.wait_for(lambda: _ready_with_new_pid(server, "gate", pid), "a new worker")
    assert _worker(server, "gate")["restarts"] == 1
    assert requests.get(f"{server.inference}/ping", timeout=10).status_code == 200


def test_a_hung_handler_answers_504_and_its_worker_is_replaced(build_mar, start_server) -> None:
    build_mar("sleepy", "sleep")
    server = start_server()
    pid = _register_one_worker(server, "sleepy", response_timeout_s=1)
    started = time.monotonic()
    hung = server.predict("sleepy", b"30")
    assert hung.status_code == 504
    assert time.monotonic() - started < 10
    server.wait_for(lambda: gone(pid), "the hung worker")
    server.wait_for(lambda: _ready_with_new_pid(server, "sleepy", pid), "a new worker")
    assert server.predict("sleepy", b"0").status_code == 200


def test_a_worker_that_keeps_dying_backs_off_and_is_reported_unhealthy(
        build_mar, start_server) -> None:
    build_mar("crash", "crash")
    server = start_server("crash.mar")
    deaths = []
    for _ in range(3):
        server.wait_for(lambda: _worker(server, "crash")["status"] == "READY", "the worker")
        answer = server.predict("crash", b"crash")
        assert answer.status_code == 500 and "Worker died" in answer.json()["message"]
        deaths.append(time.monotonic())
    # Restarts back off: 0.5 s, then 1 s, then 2 s before the next start.
    assert deaths[2] - deaths[1] > deaths[1] - deaths[0]
    assert server.describe("crash")["status"] == "Unhealthy"
    ping = requests.get(f"{server.inference}/ping", timeout=10)
    assert ping.status_code == 500 and ping.json() == {"status": "Unhealthy"}
    server.wait_for(lambda: _worker(server, "crash")["status"] == "READY", "the worker")
    assert server.predict("crash", b"fine").content == b"fine"
    assert server.describe("crash")["status"] == "Healthy"


def test_a_handler_that_fails_to_load_reports_why_without_a_restart_storm(
        build_mar, start_server) -> None:
    build_mar("bad", "echo:missing_function")
    server = start_server()
    failed = requests.post(f"{server.management}/models",
                           params={"url": "bad.mar", "synchronous": "false"}, timeout=30)
    assert failed.status_code == 202
    server.wait_for(lambda: "missing_function" in str(_worker(server, "bad").get("lastError")),
                    "the load error in describe")
    started = time.monotonic()
    server.wait_for(lambda: server.describe("bad")["status"] == "Unhealthy",
                    "the model to be reported unhealthy")
    # Three failed starts: the second at once, the third after a 0.5 s backoff (then 1 s,
    # 2 s, ...), not a tight loop.
    assert time.monotonic() - started > 0.4
    assert int(_worker(server, "bad")["restarts"]) <= 3  # type: ignore[call-overload]


def test_a_worker_that_cannot_be_restarted_keeps_trying_is_reported_and_recovers(
        build_mar, start_server, tmp_path: Path, caplog) -> None:
    build_mar("echo", "echo")
    run_dir = tmp_path / "run"
    server = start_server("echo.mar", run_dir=run_dir)
    pid = int(_worker(server, "echo")["pid"])  # type: ignore[call-overload]
    moved = tmp_path / "run-moved"
    # Without its run directory the worker's socket cannot be made: every restart fails with
    # an OSError (as EMFILE or a failed fork would), which used to end its supervisor silently.
    run_dir.rename(moved)
    os.kill(pid, signal.SIGKILL)
    server.wait_for(lambda: server.describe("echo")["status"] == "Unhealthy",
                    "the model to be reported unhealthy")
    worker = _worker(server, "echo")
    assert worker["pid"] == -1 and "could not be started" in str(worker["lastError"])
    assert "could not be started" in caplog.text
    ping = requests.get(f"{server.inference}/ping", timeout=10)
    assert ping.status_code == 500 and ping.json() == {"status": "Unhealthy"}
    started = time.monotonic()
    refused = server.predict("echo", b"x")
    assert refused.status_code == 503, refused.text
    assert "no working worker" in refused.json()["message"]
    assert time.monotonic() - started < 5  # an answer now, not at response_timeout

    moved.rename(run_dir)
    server.wait_for(lambda: _worker(server, "echo")["status"] == "READY", "the worker to recover")
    assert server.predict("echo", b"back").content == b"back"
    assert requests.get(f"{server.inference}/ping", timeout=10).status_code == 200


@pytest.mark.parametrize(("mode", "code"), [("spawn-and-die", 3), ("fork-and-die", 4)])
def test_a_worker_that_dies_while_a_child_holds_its_socket_fails_its_batch_promptly(
        build_mar, start_server, tmp_path: Path, mode: str, code: int) -> None:
    build_mar("forker", "forker")
    server = start_server()
    pid = _register_one_worker(server, "forker", response_timeout_s=60)
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    answer = server.predict("forker", f"{mode}:{pid_file}".encode())
    assert answer.status_code == 500, answer.text
    assert time.monotonic() - started < 5  # not the 60 s response timeout
    assert f"exited with code {code}" in answer.json()["message"]
    child = int(pid_file.read_text())
    # What the dead worker left running is stopped with it.
    server.wait_for(lambda: gone(child), "the orphan")
    server.wait_for(lambda: _ready_with_new_pid(server, "forker", pid), "a new worker")
    assert server.predict("forker", b"again").content == b"again"


def test_a_worker_restart_that_hits_emfile_is_retried_until_descriptors_are_free(
        build_mar, server_process) -> None:
    """The report's reproduction: lower the frontend's RLIMIT_NOFILE, hold many idle
    connections, kill -9 the worker, release the connections."""
    import resource
    import socket
    from urllib.parse import urlsplit

    build_mar("echo", "echo")
    server = server_process("echo=echo.mar")
    frontend = server.process.pid
    described = requests.get(f"{server.management}/models/echo", timeout=10).json()[0]
    pid = described["workers"][0]["pid"]
    limit = len(os.listdir(f"/proc/{frontend}/fd")) + 20
    resource.prlimit(frontend, resource.RLIMIT_NOFILE, (limit, limit))
    address = urlsplit(server.inference)
    held = [socket.create_connection((address.hostname, address.port)) for _ in range(100)]
    try:
        server.wait_for(lambda: len(os.listdir(f"/proc/{frontend}/fd")) >= limit - 2,
                        "the frontend to run out of descriptors")
        os.kill(pid, signal.SIGKILL)
        server.wait_for(lambda: "could not be started" in server.log_text(),
                        "a restart to fail for want of descriptors")
    finally:
        for connection in held:
            connection.close()

    def recovered() -> bool:
        worker = requests.get(f"{server.management}/models/echo",
                              timeout=10).json()[0]["workers"][0]
        return worker["status"] == "READY" and worker["pid"] not in (pid, -1)

    server.wait_for(recovered, "the worker to come back", timeout_s=60)
    assert requests.post(f"{server.inference}/predictions/echo", data=b"back",
                         timeout=30).content == b"back"
    assert server.is_alive()


def test_a_worker_killed_with_two_batches_in_flight_answers_each_request_once(
        build_mar, start_server, tmp_path: Path) -> None:
    build_mar("gate", "gate")
    server = start_server()
    requests.post(f"{server.management}/models", params={
        "url": "gate.mar", "batch_size": 2, "max_batch_delay": 10_000, "batch_policy": "fixed",
        "initial_workers": 1, "synchronous": "true"}, timeout=60).raise_for_status()
    pid = int(_worker(server, "gate")["pid"])  # type: ignore[call-overload]
    gate = tmp_path / "open"
    body = str(gate).encode()
    with ThreadPoolExecutor(5) as pool:
        held = [pool.submit(server.predict, "gate", body) for _ in range(4)]
        # The first batch computes; the second, full, is in the worker already.
        server.wait_for(lambda: server.describe("gate")["batching"]["inFlightBatches"] == 2,  # type: ignore[index]
                        "two batches in the worker")
        queued = pool.submit(server.predict, "gate", body)
        server.wait_for(
            lambda: server.describe("gate")["jobQueueStatus"]["pendingRequests"] == 1,  # type: ignore[index]
            "a fifth request in the queue")
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        answers = [future.result(timeout=10) for future in held]
        assert time.monotonic() - killed_at < 2.0
        assert [a.status_code for a in answers] == [500] * 4
        assert all("Worker died" in a.json()["message"] for a in answers)
        gate.touch()  # the queued request was never sent: the new worker serves it
        server.wait_for(lambda: _ready_with_new_pid(server, "gate", pid), "a new worker")
        partner = pool.submit(server.predict, "gate", body)  # fills its batch
        assert queued.result(timeout=60).status_code == 200
        assert partner.result(timeout=60).status_code == 200
    assert server.describe("gate")["batching"]["recentBatchSizes"][-1] == 2  # type: ignore[index]
