"""HTTP/1.1 connection semantics of the inference port, over raw sockets.

Predictions are answered by a connection-level fast path (frontend/api/http/fast.py) and every
other request by the ASGI apps; these tests mix the two on one connection: pipelining,
``Expect: 100-continue``, HTTP/1.0, refusals before the body, and clients that leave halfway.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

from tests.conftest import RunningServer

ANSWER_WITHIN_S = 10.0


class Connection:
    """A raw keep-alive connection that reads whole responses (Content-Length or chunked)."""

    def __init__(self, server: RunningServer, base: str | None = None) -> None:
        address = urlsplit(base or server.inference)
        self.sock = socket.create_connection((address.hostname, address.port),
                                             timeout=ANSWER_WITHIN_S)
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buffer += chunk
        return bool(chunk)

    def _take_until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            if not self._fill():
                raise AssertionError(f"connection closed; got {self.buffer[:200]!r}")
        data, _, self.buffer = self.buffer.partition(marker)
        return data

    def _take(self, size: int) -> bytes:
        while len(self.buffer) < size:
            if not self._fill():
                raise AssertionError("connection closed in a body")
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data

    def response(self) -> tuple[int, dict[str, str], bytes]:
        head = self._take_until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        status = int(head[0].split(" ")[1])
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if status == 100:
            return status, headers, b""
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int(self._take_until(b"\r\n"), 16):
                body += self._take(size)
                self._take(2)
            self._take(2)
            return status, headers, body
        return status, headers, self._take(int(headers.get("content-length", "0")))

    def closed_by_server(self) -> bool:
        self.sock.settimeout(ANSWER_WITHIN_S)
        return not self.buffer and self.sock.recv(1) == b""


def _post(path: str, body: bytes, *extra: bytes, version: bytes = b"1.1") -> bytes:
    return (b"POST " + path.encode() + b" HTTP/" + version + b"\r\nHost: test\r\n"
            + b"".join(line + b"\r\n" for line in extra)
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


@pytest.fixture
def echo(build_mar, start_server) -> RunningServer:
    build_mar("echo", "echo")
    return start_server("echo.mar", max_request_size_bytes=1024)


@pytest.fixture
def connection(echo: RunningServer):
    conn = Connection(echo)
    yield conn
    conn.close()


def test_pipelined_requests_are_answered_in_order(echo: RunningServer,
                                                  connection: Connection) -> None:
    connection.sock.sendall(_post("/predictions/echo", b"first")
                            + b"GET /ping HTTP/1.1\r\nHost: test\r\n\r\n"
                            + _post("/predictions/echo", b"second")
                            + _post("/predictions/nope", b"third")
                            + _post("/predictions/echo", b"fourth"))
    answers = [connection.response() for _ in range(5)]
    assert [status for status, _, _ in answers] == [200, 200, 200, 404, 200]
    assert answers[0][2] == b"first" and answers[2][2] == b"second"
    assert json.loads(answers[1][2]) == {"status": "Healthy"}
    assert answers[4][2] == b"fourth"
    assert len({headers["x-request-id"] for _, headers, _ in answers if "x-request-id" in headers}
               ) == 3


def test_expect_100_continue_is_answered_before_the_body(connection: Connection) -> None:
    connection.sock.sendall(b"POST /predictions/echo HTTP/1.1\r\nHost: test\r\n"
                            b"Expect: 100-continue\r\nContent-Length: 4\r\n\r\n")
    assert connection.response()[0] == 100
    connection.sock.sendall(b"body")
    status, _, body = connection.response()
    assert (status, body) == (200, b"body")


def test_a_refusal_under_expect_100_continue_closes_instead(connection: Connection) -> None:
    connection.sock.sendall(b"POST /predictions/nope HTTP/1.1\r\nHost: test\r\n"
                            b"Expect: 100-continue\r\nContent-Length: 4\r\n\r\n")
    status, headers, body = connection.response()
    assert status == 404 and json.loads(body)["code"] == 404
    assert headers["connection"] == "close"  # the held-back body will never come
    assert connection.closed_by_server()


def test_a_request_refused_before_its_body_keeps_the_connection(
        connection: Connection) -> None:
    for path, status in (("/predictions/nope", 404), ("/predictions/echo/9.9", 404),
                         ("/predictions/echo", 200)):
        connection.sock.sendall(_post(path, b"x" * 100))
        assert connection.response()[0] == status


def test_an_oversized_body_without_length_is_refused_and_closed(
        connection: Connection) -> None:
    connection.sock.sendall(b"POST /predictions/echo HTTP/1.1\r\nHost: test\r\n"
                            b"Transfer-Encoding: chunked\r\n\r\n"
                            + (b"400\r\n" + b"y" * 1024 + b"\r\n") * 2)
    status, headers, body = connection.response()
    assert status == 413 and headers["connection"] == "close"
    assert "max_request_size" in json.loads(body)["message"]
    assert connection.closed_by_server()


def test_a_chunked_body_is_served(connection: Connection) -> None:
    connection.sock.sendall(b"POST /predictions/echo HTTP/1.1\r\nHost: test\r\n"
                            b"Transfer-Encoding: chunked\r\n\r\n"
                            b"3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n")
    status, _, body = connection.response()
    assert (status, body) == (200, b"abcdefg")


def test_http_1_0_is_answered_and_closed(connection: Connection) -> None:
    connection.sock.sendall(_post("/predictions/echo", b"old", version=b"1.0"))
    status, headers, body = connection.response()
    assert (status, body) == (200, b"old")
    assert headers["connection"] == "close"
    assert connection.closed_by_server()


def test_a_client_leaving_halfway_through_its_body_harms_nobody(
        echo: RunningServer) -> None:
    for _ in range(5):
        leaving = Connection(echo)
        leaving.sock.sendall(b"POST /predictions/echo HTTP/1.1\r\nHost: test\r\n"
                             b"Content-Length: 100\r\n\r\nonly-part")
        leaving.close()
    staying = Connection(echo)
    try:
        for index in range(20):
            staying.sock.sendall(_post("/predictions/echo", b"%d" % index))
            assert staying.response()[2] == b"%d" % index
    finally:
        staying.close()
    echo.wait_for(lambda: echo.describe("echo")["jobQueueStatus"]["pendingRequests"] == 0,  # type: ignore[index]
                  "an empty queue")


@pytest.fixture
def full_queue(build_mar, start_server, tmp_path):
    """A gate model whose worker is busy and whose one-place queue is full (both answered 200
    at the end), the file that opens the gate, and a raw connection to the server."""
    build_mar("gate", "gate")
    server = start_server("gate.mar", job_queue_size=1)
    gate = tmp_path / "open"
    with ThreadPoolExecutor(2) as pool:
        waiting = server.hold_gate(pool, gate, queued=1)
        connection = Connection(server)
        try:
            yield gate, connection
        finally:
            connection.close()
            gate.touch()
        assert [answer.result(timeout=30).status_code for answer in waiting] == [200, 200]


def test_a_connection_refused_for_a_full_queue_is_served_once_there_is_room(
        full_queue) -> None:
    gate, connection = full_queue
    connection.sock.sendall(_post("/predictions/gate", str(gate).encode()))
    status, headers, _ = connection.response()
    assert status == 503 and headers["retry-after"] == "1"
    # The refused connection's next request waits unread for room, then is served.
    connection.sock.sendall(_post("/predictions/gate", str(gate).encode()))
    gate.touch()
    assert connection.response()[0] == 200


def test_a_refused_connection_is_read_again_within_retry_after(full_queue) -> None:
    _, connection = full_queue
    connection.sock.sendall(_post("/predictions/gate", b"/never"))
    assert connection.response()[0] == 503
    # The queue stays full: the next request is still answered (503), not left unread.
    connection.sock.sendall(_post("/predictions/gate", b"/never"))
    assert connection.response()[0] == 503


def test_an_idle_connection_is_closed_after_keep_alive_and_a_busy_one_is_not(
        build_mar, start_server, tmp_path) -> None:
    build_mar("gate", "gate")
    build_mar("echo", "echo")
    server = start_server("gate.mar", "echo.mar", keep_alive_timeout_s=0.3)
    idle = Connection(server)
    idle.sock.sendall(_post("/predictions/echo", b"hello"))
    assert idle.response()[0] == 200
    started = time.monotonic()
    assert idle.closed_by_server()  # the server closes it, without a request on it
    assert time.monotonic() - started < ANSWER_WITHIN_S
    idle.close()

    # A request answered after several keep-alive periods keeps its connection, which then
    # serves the next request.
    gate = tmp_path / "open"
    busy = Connection(server)
    try:
        busy.sock.sendall(_post("/predictions/gate", str(gate).encode()))
        deadline = time.monotonic() + 1.0  # > three keep-alive periods: still not closed
        busy.sock.settimeout(0.05)
        while time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                assert busy.sock.recv(1, socket.MSG_PEEK) != b"", "closed while answering"
        busy.sock.settimeout(ANSWER_WITHIN_S)
        gate.touch()
        assert busy.response()[0] == 200
        busy.sock.sendall(_post("/predictions/echo", b"again"))
        assert busy.response()[:3:2] == (200, b"again")
    finally:
        busy.close()


# Chunked bodies that no parser may accept: each must be answered 400 and the connection
# closed, with nothing after them served as a request.
MALFORMED_CHUNKS = {
    "a size that is not hex": b"zz\r\nhello\r\n0\r\n\r\n",
    "a negative size": b"-5\r\nhello\r\n0\r\n\r\n",
    "a size of 17 hex digits": b"1" * 17 + b"\r\nhello\r\n0\r\n\r\n",
    "data longer than its size": b"3\r\nhello\r\n0\r\n\r\n",
    "no CRLF after the data": b"5\r\nhello0\r\n\r\n",
    "a malformed chunk extension": b"5;\x01bad\r\nhello\r\n0\r\n\r\n",
    "a size with no line end": b"5 5\r\nhello\r\n0\r\n\r\n",
}
#: A whole request sent after each malformed body: it must not be answered.
_SMUGGLED = b"GET /ping HTTP/1.1\r\nHost: test\r\n\r\n"


def _chunked_head(method: bytes, path: bytes, *extra: bytes) -> bytes:
    return (method + b" " + path + b" HTTP/1.1\r\nHost: test\r\n"
            + b"".join(line + b"\r\n" for line in extra)
            + b"Transfer-Encoding: chunked\r\n\r\n")


def _assert_refused_and_closed(connection: Connection, case: str) -> None:
    status, headers, body = connection.response()
    assert status == 400, f"{case}: {status} {body[:200]!r}"
    assert headers["connection"] == "close", case
    assert "Invalid HTTP request" in json.loads(body)["message"], case
    assert connection.closed_by_server(), f"{case}: more was answered: {connection.buffer!r}"


@pytest.mark.parametrize("port, method, path", [
    ("inference", b"POST", b"/predictions/echo"),  # the fast path
    ("inference", b"PUT", b"/predictions/echo/1.0"),
    ("inference", b"POST", b"/v1/models/echo:predict"),  # ASGI routes
    ("inference", b"POST", b"/explanations/echo"),
    ("inference", b"POST", b"/predictions/nope"),  # refused at its head (404)
    ("management", b"POST", b"/models?url=echo.mar"),
    ("metrics", b"POST", b"/metrics"),
])
def test_a_malformed_chunked_body_is_answered_400_and_closed(
        echo: RunningServer, port: str, method: bytes, path: bytes) -> None:
    base = getattr(echo, port)
    for case, chunks in MALFORMED_CHUNKS.items():
        connection = Connection(echo, base)  # the head and its broken body in one read
        try:
            connection.sock.sendall(_chunked_head(method, path) + chunks + _SMUGGLED)
            if path == b"/predictions/nope":  # refused before its body: the 404, then close
                assert connection.response()[0] == 404, case
                assert connection.closed_by_server(), case
            else:
                _assert_refused_and_closed(connection, case)
        finally:
            connection.close()


@pytest.mark.parametrize("path", [b"/predictions/echo", b"/v1/models/echo:predict"])
def test_a_chunked_body_that_breaks_after_its_head_was_read_is_answered(
        echo: RunningServer, path: bytes) -> None:
    """The head is read (the server says 100 Continue), then a good chunk, then a bad one."""
    for case, chunks in MALFORMED_CHUNKS.items():
        connection = Connection(echo)
        try:
            connection.sock.sendall(_chunked_head(b"POST", path, b"Expect: 100-continue"))
            assert connection.response()[0] == 100, case
            connection.sock.sendall(b'2\r\n{"\r\n' + chunks + _SMUGGLED)
            _assert_refused_and_closed(connection, case)
        finally:
            connection.close()


def test_a_malformed_body_behind_a_pipelined_request_is_answered_in_its_turn(
        echo: RunningServer, connection: Connection) -> None:
    connection.sock.sendall(_post("/predictions/echo", b"first") + _SMUGGLED
                            + _chunked_head(b"POST", b"/v1/models/echo:predict")
                            + MALFORMED_CHUNKS["a negative size"] + _SMUGGLED)
    assert connection.response()[:3:2] == (200, b"first")
    assert connection.response()[0] == 200  # the /ping before it
    _assert_refused_and_closed(connection, "pipelined")
    # The server is still up, and the refusals were counted.
    assert echo.predict("echo", b"after").content == b"after"


@pytest.mark.parametrize("path", [b"/predictions/echo", b"/v1/models/echo:predict"])
@pytest.mark.parametrize("after", [b"GARBAGE\x01\r\n\r\n", b"\x01", b"zz\r\n"])
def test_a_complete_request_before_bad_bytes_is_answered_before_the_400(
        echo: RunningServer, path: bytes, after: bytes) -> None:
    """The bad bytes belong to the next request's head, not to the body before them: the
    request whose body was whole gets its own answer first."""
    connection = Connection(echo)
    try:
        connection.sock.sendall(_chunked_head(b"POST", path, b"Content-Type: application/json")
                                + b'e\r\n{"instances":[\r\n3\r\n1]}\r\n0\r\n\r\n' + after)
        status, _, body = connection.response()
        assert status == 200, body
        _assert_refused_and_closed(connection, repr(after))
    finally:
        connection.close()
