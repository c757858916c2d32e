"""Deadlines and abandoned requests: answered or dropped before they reach a worker."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

from tests.conftest import RunningServer


def _requests_run(server: RunningServer) -> int:
    return int(server.describe("gate")["batching"]["requestsTotal"])  # type: ignore[index]


def test_x_request_timeout_expires_a_queued_request(build_mar, start_server,
                                                    tmp_path: Path) -> None:
    build_mar("gate", "gate")
    server = start_server("gate.mar")
    gate = tmp_path / "open"
    with ThreadPoolExecutor(1) as pool:
        (held,) = server.hold_gate(pool, gate)
        late = server.predict("gate", b"/late", headers={"X-Request-Timeout": "0.2"})
        gate.touch()
        assert held.result(timeout=30).status_code == 200
    assert late.status_code == 504
    assert late.json()["code"] == 504
    assert server.predict("gate", str(gate).encode()).status_code == 200
    assert _requests_run(server) == 2  # the expired one never ran
    bad = server.predict("gate", b"x", headers={"X-Request-Timeout": "soon"})
    assert bad.status_code == 400


def test_a_client_that_hangs_up_is_dropped_from_the_queue(build_mar, start_server,
                                                          tmp_path: Path) -> None:
    build_mar("gate", "gate")
    server = start_server("gate.mar")
    gate = tmp_path / "open"
    address = urlsplit(server.inference)
    with ThreadPoolExecutor(1) as pool:
        (held,) = server.hold_gate(pool, gate)
        body = b"/abandoned"
        with socket.create_connection((address.hostname, address.port), timeout=10) as client:
            client.sendall(b"POST /predictions/gate HTTP/1.1\r\nHost: x\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            server.wait_for(
                lambda: server.describe("gate")["jobQueueStatus"]["pendingRequests"] == 1,  # type: ignore[index]
                "the request to be queued")
        gate.touch()
        assert held.result(timeout=30).status_code == 200
    assert server.predict("gate", str(gate).encode()).status_code == 200
    assert _requests_run(server) == 2  # the abandoned one never ran


def test_client_timeout_in_mills_is_the_deadline_of_a_request_without_one(
        build_mar, start_server, tmp_path: Path) -> None:
    """model-config.yaml ``clientTimeoutInMills``: a request whose client sets no deadline
    expires in the queue after it (TorchServe drops it unanswered; here it gets a 504)."""
    config = tmp_path / "model-config.yaml"
    config.write_text("clientTimeoutInMills: 200\n")
    build_mar("gate", "gate", config_file=config)
    server = start_server("gate.mar")
    assert server.describe("gate")["clientTimeoutInMills"] == 200
    gate = tmp_path / "open"
    with ThreadPoolExecutor(1) as pool:
        (held,) = server.hold_gate(pool, gate)  # dispatched: it outlives the 200 ms
        late = server.predict("gate", b"/late")
        gate.touch()
        assert held.result(timeout=30).status_code == 200
    assert late.status_code == 504, late.text
    assert _requests_run(server) == 1  # the expired one never ran
