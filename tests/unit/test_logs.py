"""The logs as TorchServe writes them (frontend/observe/logs.py): the access line's message
(HTTP and gRPC), what ``access_log_extended`` adds and to what, the model log's records as
TorchServe's reader threads log them, the server log's file from the first record on; and
who writes each request's one access line (the plane, or the HTTP apps' wrapper)."""

from __future__ import annotations

import asyncio
import io
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from frontend.api.http import common
from frontend.api.http.app import CountedResponses
from frontend.api.http.calls import http_origin, request_target
from frontend.observe.logs import (
    AccessLog,
    console_logging,
    grpc_status,
    log_output,
    open_server_log,
    pattern_handler,
)
from tests.unit.services import call, scope

STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d{3}"


def _lines(log: AccessLog) -> list[str]:
    log.flush()
    assert log.path is not None
    return log.path.read_text().splitlines()


@pytest.fixture
def access(tmp_path: Path) -> Iterator[AccessLog]:
    log = AccessLog(tmp_path / "access_log.log")
    log.open()
    yield log
    log.close()


def test_an_access_line_is_torchserves_session_line(access: AccessLog) -> None:
    access.write("/127.0.0.1:41696", "PUT", "/predictions/mnist?x=1", "HTTP/1.1", 200,
                 0.0072, "mnist", "1.0", 0.001, 1)
    access.request("/127.0.0.1:46924", "GET", "/models", "HTTP/1.1", 200, 0.0031)
    assert [re.sub(STAMP, "T", line) for line in _lines(access)] == [
        'T - /127.0.0.1:41696 "PUT /predictions/mnist?x=1 HTTP/1.1" 200 7',
        'T - /127.0.0.1:46924 "GET /models HTTP/1.1" 200 3']


def test_a_grpc_line_has_its_status_code(access: AccessLog) -> None:
    method = "org.pytorch.serve.grpc.inference.InferenceAPIsService/Predictions"
    for status in (200, 404, 400, 503, 504, 0, 500, 401):
        access.write("/127.0.0.1:1", "gRPC", method, "HTTP/2.0", status, 0.0, "m", "1", 0, 0)
    codes = [int(line.rsplit(" ", 2)[1]) for line in _lines(access)]
    # OK, NOT_FOUND, INVALID_ARGUMENT, UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED (the client
    # left), INTERNAL, UNAUTHENTICATED: grpc's own numbers.
    assert codes == [0, 5, 3, 14, 4, 1, 13, 16]
    assert grpc_status(204) == 0 and grpc_status(413) == 8


def test_the_extended_line_adds_batchserves_fields_to_predictions_only(tmp_path: Path) -> None:
    log = AccessLog(tmp_path / "access_log.log", phases=False, extended=True)
    log.open()
    assert log.extended
    log.write("/127.0.0.1:1", "POST", "/predictions/m", "HTTP/1.1", 200, 0.0105, "m", "2.0",
              0.0025, 3)
    log.request("/127.0.0.1:2", "GET", "/ping", "HTTP/1.1", 200, 0.0)
    predicted, pinged = [re.sub(STAMP, "T", line) for line in _lines(log)]
    assert predicted == ('T - /127.0.0.1:1 "POST /predictions/m HTTP/1.1" 200 10 model=m '
                         "version=2.0 queue_ms=2.50 batch=3")
    assert pinged == 'T - /127.0.0.1:2 "GET /ping HTTP/1.1" 200 0'
    log.close()


def test_a_field_with_unprintable_characters_is_escaped(access: AccessLog) -> None:
    access.request("/127.0.0.1:1", "GET", "/a\x85b\x1b[2J", "HTTP/1.1", 404, 0.0)
    [line] = _lines(access)
    assert line.endswith('"GET /a\\x85b\\x1b[2J HTTP/1.1" 404 0') and line.isprintable()


def test_a_line_of_a_worker_is_a_model_log_record_on_its_reader_thread() -> None:
    stream = io.StringIO()
    model_log = logging.getLogger("test.model_log")
    model_log.propagate = False
    model_log.setLevel(logging.INFO)
    handler = pattern_handler(logging.StreamHandler(stream))
    model_log.addHandler(handler)
    try:
        log_output(model_log, "W-9003-mnist_1.0-stdout", "loaded")
        log_output(model_log, "W-9003-mnist_1.0-stderr", "a warning", logging.WARNING)
        log_output(model_log, "W-9003-mnist_1.0-stdout", "not shown", logging.DEBUG)
    finally:
        model_log.removeHandler(handler)
    assert [re.sub(STAMP, "T", line) for line in stream.getvalue().splitlines()] == [
        "T [INFO ] W-9003-mnist_1.0-stdout MODEL_LOG - loaded",
        "T [WARN ] W-9003-mnist_1.0-stderr MODEL_LOG - a warning"]


@pytest.fixture
def bare_root() -> Iterator[logging.Logger]:
    """The root logger, which the test empties of handlers (as a fresh process's: pytest adds
    its own for the test's call), restored afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:], root.level = handlers, level


def test_the_server_log_file_begins_with_the_first_record(
        tmp_path: Path, bare_root: logging.Logger) -> None:
    console = io.StringIO()
    bare_root.handlers[:] = []
    console_logging(console, server_log=True)
    logging.getLogger("batchserve").info("before the configuration said where")
    assert open_server_log(tmp_path / "logs", console) is False
    logging.getLogger("frontend.server").warning("after")
    lines = (tmp_path / "logs" / "ts_log.log").read_text().splitlines()
    assert [re.sub(STAMP, "T", line) for line in lines] == [
        "T [INFO ] MainThread batchserve - before the configuration said where",
        "T [WARN ] MainThread frontend.server - after"]
    assert console.getvalue().splitlines() == lines  # the console's lines, the same layout


def test_no_second_writer_where_the_console_is_the_server_log(
        tmp_path: Path, bare_root: logging.Logger) -> None:
    (tmp_path / "logs").mkdir()
    with (tmp_path / "logs" / "ts_log.log").open("a") as console:  # a background start's
        bare_root.handlers[:] = []
        console_logging(console, server_log=True)
        logging.getLogger("batchserve").info("once")
        assert open_server_log(tmp_path / "logs", console) is True
        logging.getLogger("batchserve").info("twice?")
    assert len((tmp_path / "logs" / "ts_log.log").read_text().splitlines()) == 2
    # Without the default logging (a --log-config set it), nothing is opened.
    assert open_server_log(tmp_path / "other", io.StringIO()) is False
    assert not (tmp_path / "other").exists()


def test_the_request_target_is_the_request_lines_as_sent() -> None:
    sent = {**scope("GET", "/a b"), "raw_path": b"/a%20b", "query_string": b"x=%0d"}
    assert request_target(sent) == "/a%20b?x=%0d"
    assert request_target(scope("GET", "/models")) == "/models"


def test_each_http_request_gets_one_access_line(access: AccessLog) -> None:
    async def plain(scope: common.Scope, receive: common.Receive, send: common.Send) -> None:
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def prediction(scope: common.Scope, receive: common.Receive,
                         send: common.Send) -> None:
        origin = http_origin(scope)  # the plane's: it writes the line once the call ends
        access.write(origin.peer, origin.method, origin.uri, origin.protocol, 200, 0.0,
                     "m", "1.0", 0.0, 1)
        origin.recorded = True
        await plain(scope, receive, send)

    async def refused(scope: common.Scope, receive: common.Receive,
                      send: common.Send) -> None:
        http_origin(scope)  # refused before the plane wrote anything: the wrapper writes it
        await plain(scope, receive, send)

    async def requests() -> None:
        counted: list[int] = []
        await call(CountedResponses(plain, counted.append, access), "DELETE", "/models/m")
        await call(CountedResponses(prediction, counted.append, access), "POST", "/p/m")
        await call(CountedResponses(refused, counted.append, access), "POST", "/wfpredict/w")
        assert counted == [204, 204, 204]

    asyncio.run(requests())
    assert [re.sub(STAMP, "T", line) for line in _lines(access)] == [
        'T - /127.0.0.1:50000 "DELETE /models/m HTTP/1.1" 204 0',
        'T - /127.0.0.1:50000 "POST /p/m HTTP/1.1" 200 0',
        'T - /127.0.0.1:50000 "POST /wfpredict/w HTTP/1.1" 204 0']
