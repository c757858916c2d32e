"""Request heads are bounded in size and in time on every HTTP port, and an Upgrade that is
not performed does not cost a request its body (raw sockets against the real server)."""

from __future__ import annotations

import select
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from frontend.api.http.protocol import (
    MAX_HEAD_BYTES,
    MAX_HEADER_LINE_BYTES,
    MAX_HEADERS,
    MAX_URL_BYTES,
)
from tests.conftest import RunningServer
from tests.integration.test_http_connections import Connection, _post

PORTS = ("inference", "management", "metrics")
HEADER_TIMEOUT_S = 1.0


@pytest.fixture
def server(build_mar, start_server) -> RunningServer:
    build_mar("echo", "echo")
    return start_server("echo.mar", request_header_timeout_s=HEADER_TIMEOUT_S)


def _base(server: RunningServer, port: str) -> str:
    return str(getattr(server, port))


def _refused(server: RunningServer, port: str, request: bytes) -> tuple[int, bytes, float]:
    """Send ``request`` (as fast as the socket takes it); the refusal, and how long it took."""
    connection = Connection(server, _base(server, port))
    started = time.monotonic()
    try:
        try:
            connection.sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before we were done sending: the answer is still there to read
        status, headers, body = connection.response()
        assert headers.get("connection") == "close"
        assert connection.closed_by_server()
        return status, body, time.monotonic() - started
    finally:
        connection.close()


def _still_serving(server: RunningServer) -> None:
    assert requests.get(f"{server.inference}/ping", timeout=10).status_code == 200
    assert server.predict("echo", b"fine").content == b"fine"


@pytest.mark.parametrize("port", PORTS)
def test_a_long_url_is_refused_414_at_once(server: RunningServer, port: str) -> None:
    status, body, _ = _refused(server, port, b"GET /" + b"a" * (MAX_URL_BYTES + 1)
                               + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 414 and b"URL exceeds" in body
    _still_serving(server)


@pytest.mark.parametrize("port", PORTS)
def test_a_huge_url_is_not_read_in_full(server: RunningServer, port: str) -> None:
    # 32 MB of URL: refused after the first few kilobytes, long before it could all be sent.
    status, _, _ = _refused(server, port, b"POST /predictions/" + b"a" * (32 << 20))
    assert status == 414
    _still_serving(server)


@pytest.mark.parametrize("port", PORTS)
def test_a_header_line_too_long_is_refused_431(server: RunningServer, port: str) -> None:
    status, body, _ = _refused(server, port, _post(
        "/predictions/echo", b"x", b"X-Big: " + b"b" * MAX_HEADER_LINE_BYTES))
    assert status == 431 and b"header exceeds" in body
    _still_serving(server)


@pytest.mark.parametrize("port", PORTS)
def test_a_64_mb_header_is_refused_without_being_read(server: RunningServer, port: str) -> None:
    status, _, _ = _refused(server, port, b"POST /predictions/echo HTTP/1.1\r\nX-Big: "
                            + b"b" * (64 << 20) + b"\r\n\r\n")
    assert status == 431
    _still_serving(server)


def test_too_many_headers_or_too_large_a_head_is_refused_431(server: RunningServer) -> None:
    many = [b"X-H%d: v" % i for i in range(MAX_HEADERS + 1)]
    status, body, _ = _refused(server, "inference", _post("/predictions/echo", b"x", *many))
    assert status == 431 and b"at most" in body
    # Each line within its limit, the head as a whole over MAX_HEAD_BYTES: sent slowly enough
    # that it arrives in several reads.
    line = b"X-Part: " + b"p" * (MAX_HEADER_LINE_BYTES - 100) + b"\r\n"
    connection = Connection(server)
    try:
        connection.sock.sendall(b"POST /predictions/echo HTTP/1.1\r\n")
        sent = 0
        while sent < 4 * MAX_HEAD_BYTES and not select.select([connection.sock], [], [], 0)[0]:
            connection.sock.sendall(line)
            sent += len(line)
            time.sleep(0.02)
        status, _, _ = connection.response()
    finally:
        connection.close()
    assert sent < 2 * MAX_HEAD_BYTES  # refused once past the limit, not at the end
    assert status == 431
    # A head of many ordinary headers under the limits is served.
    ok = [b"X-H%d: %s" % (i, b"v" * 100) for i in range(MAX_HEADERS - 10)]  # requests adds its own
    assert requests.post(f"{server.inference}/predictions/echo", data=b"ok", timeout=10,
                         headers={k.split(b":")[0].decode(): "v" * 100
                                  for k in ok}).content == b"ok"


@pytest.mark.parametrize("port", PORTS)
def test_a_head_that_trickles_in_is_refused_408_at_the_header_timeout(
        server: RunningServer, port: str) -> None:
    connection = Connection(server, _base(server, port))
    try:
        connection.sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        for _ in range(int(HEADER_TIMEOUT_S * 20)):  # slowloris: a header now and then
            try:
                connection.sock.sendall(b"X-Slow: 1\r\n")
            except OSError:
                break
            time.sleep(0.1)
        status, headers, _ = connection.response()
        assert status == 408 and headers.get("connection") == "close"
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 5
    finally:
        connection.close()
    _still_serving(server)


def test_a_silent_connection_is_closed_at_the_header_timeout(server: RunningServer) -> None:
    connections = [Connection(server, _base(server, port)) for port in PORTS]
    try:
        for connection in connections:
            assert connection.closed_by_server()  # within ANSWER_WITHIN_S, without a word
    finally:
        for connection in connections:
            connection.close()


def test_a_slow_prediction_is_not_cut_by_the_header_timeout(build_mar, start_server) -> None:
    build_mar("sleepy", "sleep")
    server = start_server("sleepy.mar", request_header_timeout_s=HEADER_TIMEOUT_S)
    connection = Connection(server)
    try:
        for _ in range(2):  # and the keep-alive connection serves the next one too
            connection.sock.sendall(_post("/predictions/sleepy", b"%.1f" % (2 * HEADER_TIMEOUT_S)))
            status, _, body = connection.response()
            assert status == 200 and body == b"%.1f" % (2 * HEADER_TIMEOUT_S)
    finally:
        connection.close()


def test_refused_requests_pipelined_behind_a_prediction_are_answered_in_order(
        build_mar, start_server) -> None:
    build_mar("sleepy", "sleep")
    server = start_server("sleepy.mar")
    connection = Connection(server)
    try:
        connection.sock.sendall(_post("/predictions/sleepy", b"0.3") + b"GET /"
                                + b"u" * (MAX_URL_BYTES + 1) + b" HTTP/1.1\r\n\r\n")
        first = connection.response()
        second = connection.response()
        assert (first[0], first[2]) == (200, b"0.3")
        assert second[0] == 414
        assert connection.closed_by_server()
    finally:
        connection.close()


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_an_upgrade_we_do_not_perform_still_reads_the_body(
        server: RunningServer, framing: str) -> None:
    # What `curl --http2 -d hello http://...` sends: an h2c upgrade offer with a body.
    upgrade = (b"Connection: Upgrade, HTTP2-Settings", b"Upgrade: h2c",
               b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA")
    connection = Connection(server)
    try:
        for body in (b"hello", b"again"):  # and the connection goes on as HTTP/1.1
            if framing == "length":
                connection.sock.sendall(_post("/predictions/echo", body, *upgrade))
            else:
                connection.sock.sendall(
                    b"POST /predictions/echo HTTP/1.1\r\nHost: x\r\n"
                    + b"".join(line + b"\r\n" for line in upgrade)
                    + b"Transfer-Encoding: chunked\r\n\r\n"
                    + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
            status, _, answer = connection.response()
            assert (status, answer) == (200, body)
        connection.sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                                b"Upgrade: websocket\r\n\r\n")
        assert connection.response()[0] == 200
    finally:
        connection.close()


def test_limits_hold_under_many_concurrent_abusers(server: RunningServer) -> None:
    def abuse(index: int) -> int:
        request = (b"GET /" + b"a" * (MAX_URL_BYTES * 2) + b" HTTP/1.1\r\n\r\n" if index % 2
                   else _post("/predictions/echo", b"x", b"X-Big: " + b"b" * (1 << 20)))
        return _refused(server, "inference", request)[0]

    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(abuse, range(32)))
    assert sorted(set(statuses)) == [414, 431]
    _still_serving(server)


def test_a_curl_http2_request_gets_its_body_through(server: RunningServer) -> None:
    import shutil
    import subprocess

    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    answer = subprocess.run([curl, "-s", "--http2", "-H", "Content-Type: text/plain", "-d", "hello",
                             f"{server.inference}/predictions/echo"],
                            capture_output=True, timeout=30, check=True)
    assert answer.stdout == b"hello"
