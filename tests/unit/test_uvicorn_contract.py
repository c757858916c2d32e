"""The uvicorn internals our HTTP ports build on, checked one by one.

uvicorn is pinned to one minor version, 0.54 (setup.py: ``uvicorn>=0.54,<0.55``), because
frontend/api/http/ builds on parts of it that are not its public API:

- ``protocol.py``: ``ServerProtocol`` extends the private ``HttpToolsProtocol`` (bounded request
  heads, a head deadline, ignored upgrades, lingering close) and replaces its
  ``data_received``;
- ``fast.py``: ``PredictionsProtocol`` answers ``/predictions`` from the parser callbacks, poses
  as uvicorn's request cycle (``_Prediction``), reuses ``STATUS_LINE``, the header checks and
  ``RequestResponseCycle`` (streamed answers), and hands every other request to uvicorn's ASGI
  cycle;
- ``app.py``: drives ``uvicorn.Server`` by ``startup``/``shutdown`` and creates
  ``server.lifespan`` as ``Server._serve`` does (``serve()`` would take over the process's
  signals).

Pinned rather than rewritten on uvicorn's public API (which offers no hook below the ASGI
app): that behaviour (414/431 limits, the head deadline, keep-alive, pipelining,
``Expect: 100-continue``, ignored upgrades, lingering close) is already tested end to end, and
a second HTTP/1.1 implementation would be more code to get right than this file.

**A uvicorn upgrade (moving the pin) must pass this file first.** A failure names what
changed; re-read the code that uses it (named in each test's docstring) before updating the
expected values here.

Names and shapes are checked here. Behaviour on a real server is checked by the integration
tests, not repeated here:

- ASGI hand-off of other requests on a fast-path connection, in order:
  test_http_connections.py::test_pipelined_requests_are_answered_in_order,
  test_serving.py::test_unknown_model_and_path_are_404_with_torchserve_error_body;
- keep-alive after a prediction: test_http_connections.py::
  test_a_request_refused_before_its_body_keeps_the_connection,
  test_an_idle_connection_is_closed_after_keep_alive_and_a_busy_one_is_not,
  test_a_client_leaving_halfway_through_its_body_harms_nobody;
- ``Expect: 100-continue``: test_http_connections.py::
  test_expect_100_continue_is_answered_before_the_body,
  test_a_refusal_under_expect_100_continue_closes_instead;
- HTTP/1.0 and chunked bodies: test_http_connections.py::test_http_1_0_is_answered_and_closed,
  test_a_chunked_body_is_served;
- read pausing (``flow``) on a full queue: test_http_connections.py::
  test_a_connection_refused_for_a_full_queue_is_served_once_there_is_room,
  test_a_refused_connection_is_read_again_within_retry_after;
- head limits, head deadline, lingering close, ignored upgrades: test_http_limits.py (all);
- streamed answers (``RequestResponseCycle``): test_serving.py::
  test_intermediate_responses_stream_as_http_chunks;
- header checks: test_bad_input.py::
  test_a_response_header_that_would_split_the_response_fails_only_its_request;
- graceful shutdown (``Server.shutdown``, ``HttpToolsProtocol.shutdown``): test_serving.py::
  test_stop_finishes_in_flight_requests_before_stopping_workers;
- responses counted by status: test_observability.py::test_refused_requests_are_counted,
  test_metrics_count_what_happened.
"""

from __future__ import annotations

import ast
import asyncio
import collections
import inspect
import logging
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httptools
import pytest
import uvicorn
from uvicorn.lifespan.off import LifespanOff
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.server import ServerState

from frontend.api.http import fast
from frontend.api.http.app import GRACEFUL_SHUTDOWN_S, uvicorn_config
from frontend.api.http.fast import PredictionsProtocol, _Prediction, protocol_for
from frontend.api.http.protocol import ServerProtocol

ROOT = Path(__file__).resolve().parent.parent.parent
PINNED_MINOR = "0.54"


# -- helpers ------------------------------------------------------------------------------------


class _Transport(asyncio.Transport):
    """An in-memory transport: what is written, whether reading is paused, whether closed."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.reading = True
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("10.0.0.1", 4321), "sockname": ("127.0.0.1", 8080)}.get(
            name, default)


async def _asgi_app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def _protocol(loop: asyncio.AbstractEventLoop) -> HttpToolsProtocol:
    """uvicorn's protocol, built as ``Server.startup`` builds it, with our settings."""
    config = uvicorn_config(_asgi_app, HttpToolsProtocol)
    return HttpToolsProtocol(config=config, server_state=ServerState(), app_state={},
                             _loop=loop)


@pytest.fixture
def loop() -> Any:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _tree(obj: Callable[..., Any] | type) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(obj)))


def _self_attributes(obj: Callable[..., Any] | type) -> set[str]:
    """Every ``self.<name>`` that ``obj``'s source reads, writes or calls."""
    return {node.attr for node in ast.walk(_tree(obj))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "self"}


def _attributes_of(obj: Callable[..., Any], holder: str) -> set[str]:
    """Every ``<holder>.<name>`` in ``obj``'s source; ``holder`` is ``"x"`` or ``"self.x"``."""
    found = set()
    for node in ast.walk(_tree(obj)):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) == holder:
            found.add(node.attr)
    return found


def _scope_keys_written(obj: Callable[..., Any]) -> set[str]:
    """The keys ``obj`` assigns in ``self.scope[...]`` or ``scope[...]``."""
    keys: set[str] = set()
    for node in ast.walk(_tree(obj)):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant)
                        and ast.unparse(target.value) in ("self.scope", "scope")):
                    keys.add(str(target.slice.value))
    return keys


def _defined_names(cls: type) -> set[str]:
    """The names a class's own source defines: methods, class attributes (annotated too) and
    ``self.<name>`` it assigns."""
    names = set()
    class_def = _tree(cls).body[0]  # type: ignore[attr-defined]
    for node in class_def.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(class_def):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        names.update(t.attr for t in targets if isinstance(t, ast.Attribute)
                     and isinstance(t.value, ast.Name) and t.value.id == "self")
    return names


def _parameters(function: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(function).parameters)


# -- the pin ------------------------------------------------------------------------------------


def test_the_installed_uvicorn_is_the_pinned_minor() -> None:
    """setup.py's pin, this file and the installed uvicorn name one minor version."""
    assert uvicorn.__version__.startswith(PINNED_MINOR + "."), uvicorn.__version__
    major, minor = PINNED_MINOR.split(".")
    pin = f'"uvicorn>={PINNED_MINOR},<{major}.{int(minor) + 1}"'
    assert pin in (ROOT / "setup.py").read_text()


# -- module constants (fast.py, protocol.py) --------------------------------------------------


def test_status_line_is_the_http_1_1_status_line_of_every_code() -> None:
    """``STATUS_LINE[status]`` starts every response fast.py and protocol.py write."""
    assert set(STATUS_LINE) == set(range(100, 600))
    for status, phrase in ((200, b"OK"), (404, b"Not Found"), (408, b"Request Timeout"),
                           (413, b"Request Entity Too Large"), (414, b"Request-URI Too Long"),
                           (431, b"Request Header Fields Too Large"),
                           (503, b"Service Unavailable"), (507, b"Insufficient Storage")):
        assert STATUS_LINE[status] == b"HTTP/1.1 %d %s\r\n" % (status, phrase)
    assert STATUS_LINE[599] == b"HTTP/1.1 599 \r\n"  # a handler's own code: no phrase


def test_header_checks_refuse_what_would_split_a_response() -> None:
    """fast.py checks a handler's headers with uvicorn's ``HEADER_RE``/``HEADER_VALUE_RE``, as
    the ASGI path (``RequestResponseCycle.send``) does."""
    assert fast._BAD_NAME is HEADER_RE and fast._BAD_VALUE is HEADER_VALUE_RE
    for name in (b"bad name", b"a:b", b"a\r\nb", b"a\x00", b"a\x7f", b'"q"'):
        assert HEADER_RE.search(name), name
    for name in (b"x-request-id", b"content-type", b"X_Custom.1"):
        assert not HEADER_RE.search(name), name
    for value in (b"a\r\nb: c", b"a\nb", b"a\rb", b"\x00", b"\x7f"):
        assert HEADER_VALUE_RE.search(value), value
    for value in (b"text/plain; charset=utf-8", b"a\tb", b"caf\xe9", b""):
        assert not HEADER_VALUE_RE.search(value), value


# -- HttpToolsProtocol (protocol.py, fast.py) --------------------------------------------------


def test_the_protocol_is_built_as_server_startup_builds_it() -> None:
    """Our protocol classes keep uvicorn's constructor (they define none), which
    ``Server.startup`` calls with these keywords."""
    assert _parameters(HttpToolsProtocol.__init__) == [
        "self", "config", "server_state", "app_state", "_loop"]
    calls = [node for node in ast.walk(_tree(uvicorn.Server.startup))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == "http_protocol_class"]
    assert len(calls) == 1
    assert {keyword.arg for keyword in calls[0].keywords} == {
        "config", "server_state", "app_state", "_loop"}
    for cls in (ServerProtocol, PredictionsProtocol):
        assert "__init__" not in vars(cls)


@pytest.mark.parametrize(("name", "expected"), [
    ("loop", lambda protocol, loop: protocol.loop is loop),
    ("parser", lambda protocol, _: isinstance(protocol.parser, httptools.HttpRequestParser)),
    ("pipeline", lambda protocol, _: protocol.pipeline == collections.deque()),
    ("cycle", lambda protocol, _: protocol.cycle is None),
    ("scope", lambda protocol, _: protocol.scope is None),
    ("headers", lambda protocol, _: protocol.headers is None),
    ("expect_100_continue", lambda protocol, _: protocol.expect_100_continue is False),
    ("transport", lambda protocol, _: protocol.transport is None),
    ("flow", lambda protocol, _: protocol.flow is None),
    ("client", lambda protocol, _: protocol.client is None),
    ("logger", lambda protocol, _: isinstance(protocol.logger, logging.Logger)),
    ("access_logger", lambda protocol, _: isinstance(protocol.access_logger, logging.Logger)),
    ("server_state", lambda protocol, _: protocol.server_state.default_headers == []),
    ("timeout_keep_alive_task", lambda protocol, _: protocol.timeout_keep_alive_task is None),
    ("timeout_keep_alive", lambda protocol, _: protocol.timeout_keep_alive == 5.0),
])
def test_the_protocol_state_we_use_exists_from_the_start(
        loop: asyncio.AbstractEventLoop, name: str,
        expected: Callable[[HttpToolsProtocol, asyncio.AbstractEventLoop], bool]) -> None:
    """The attributes protocol.py and fast.py read (and ``parser``/``cycle``: set)."""
    protocol = _protocol(loop)
    assert name in vars(protocol)
    assert expected(protocol, loop)


@pytest.mark.parametrize(("method", "parameters"), [
    ("connection_made", ["self", "transport"]),
    ("connection_lost", ["self", "exc"]),
    ("data_received", ["self", "data"]),
    ("on_message_begin", ["self"]),
    ("on_url", ["self", "url"]),
    ("on_header", ["self", "name", "value"]),
    ("on_headers_complete", ["self"]),
    ("on_body", ["self", "body"]),
    ("on_message_complete", ["self"]),
    ("on_response_complete", ["self"]),
    ("_start_asgi_task", ["self", "cycle", "app"]),
    ("shutdown", ["self"]),
])
def test_the_methods_we_extend_or_call_keep_their_signatures(
        method: str, parameters: list[str]) -> None:
    """protocol.py and fast.py override these (calling ``super()``), or call them: the parser
    callbacks are also called by ``_AfterUpgrade``, ``shutdown`` by ``Server.shutdown``."""
    assert _parameters(getattr(HttpToolsProtocol, method)) == parameters


def test_our_names_shadow_only_what_we_mean_to_override() -> None:
    """A name uvicorn adds that one of ours already uses would silently change either side."""
    uvicorn_names = set(dir(HttpToolsProtocol)) | _defined_names(HttpToolsProtocol)
    ours = (_defined_names(ServerProtocol) | _defined_names(PredictionsProtocol)) - {
        name for name in dir(object) if name.startswith("__")}
    assert ours & uvicorn_names == {
        "connection_made", "connection_lost", "data_received", "on_message_begin",
        "on_headers_complete", "on_body", "on_message_complete", "on_response_complete",
        "shutdown",  # protocol.py: an idle TLS connection dropped soon after, at a stop
        "parser",  # protocol.py: a fresh parser after an ignored upgrade
        "cycle", "scope",  # fast.py: a prediction's cycle and its scope (annotations)
    }


def test_connection_made_sets_the_transport_flow_and_client(
        loop: asyncio.AbstractEventLoop) -> None:
    """fast.py writes to ``transport``, pauses reading with ``flow``, logs ``client``;
    ``Server.shutdown`` finds the connection in ``server_state.connections``."""
    protocol = _protocol(loop)
    transport = _Transport()
    protocol.connection_made(transport)
    assert protocol.transport is transport
    assert isinstance(protocol.flow, FlowControl)
    assert protocol.client == ("10.0.0.1", 4321)
    assert protocol in protocol.server_state.connections


def test_flow_control_pauses_and_resumes_reading_and_waits_for_writes() -> None:
    """fast.py: ``flow.pause_reading``/``resume_reading`` (a full queue), ``write_paused`` and
    ``drain`` (a streamed answer)."""

    async def scenario() -> None:
        transport = _Transport()
        flow = FlowControl(transport)
        flow.pause_reading()
        assert not transport.reading
        flow.resume_reading()
        assert transport.reading
        assert flow.write_paused is False
        flow.pause_writing()
        assert flow.write_paused is True
        drained = asyncio.ensure_future(flow.drain())
        await asyncio.sleep(0)
        assert not drained.done()
        flow.resume_writing()
        await asyncio.wait_for(drained, 1)

    asyncio.run(scenario())


def test_the_request_head_callbacks_build_url_headers_and_scope(
        loop: asyncio.AbstractEventLoop) -> None:
    """protocol.py and fast.py read ``url``, ``headers`` (names in lower case) and
    ``expect_100_continue``, and fill in the ``scope`` that ``on_message_begin`` starts."""
    protocol = _protocol(loop)
    protocol.connection_made(_Transport())
    protocol.on_message_begin()
    assert protocol.url == b"" and protocol.headers == []
    assert protocol.expect_100_continue is False
    assert set(protocol.scope) == {"type", "asgi", "http_version", "server", "client", "scheme",
                                   "root_path", "headers", "state"}
    assert protocol.scope["headers"] is protocol.headers
    assert protocol.scope["http_version"] == "1.1" and protocol.scope["root_path"] == ""
    protocol.on_url(b"/predictions/")
    protocol.on_url(b"echo")
    protocol.on_header(b"Content-Length", b"3")
    protocol.on_header(b"Expect", b"100-Continue")
    assert protocol.url == b"/predictions/echo"
    assert protocol.headers == [(b"content-length", b"3"), (b"expect", b"100-Continue")]
    assert protocol.expect_100_continue is True


def test_the_fast_path_fills_the_scope_keys_uvicorn_fills() -> None:
    """fast.py's ``handle_request`` does for a prediction what uvicorn's
    ``on_headers_complete`` does for an ASGI request, less ``root_path`` (always "" here:
    ``uvicorn_config``) and ``limit_concurrency`` (off)."""
    keys = {"method", "http_version", "path", "raw_path", "query_string"}
    assert _scope_keys_written(HttpToolsProtocol.on_headers_complete) == keys
    assert _scope_keys_written(PredictionsProtocol.handle_request) == keys
    uvicorn_reads = _self_attributes(HttpToolsProtocol.on_headers_complete)
    assert {"root_path", "limit_concurrency"} <= uvicorn_reads


def test_data_received_does_nothing_our_replacement_lacks() -> None:
    """protocol.py replaces ``data_received`` whole, keeping ``parser.feed_data``;
    ``_unset_keepalive_if_required`` cancels the timer only uvicorn's ``on_response_complete``
    arms (ours replaces it, and ``timeout_keep_alive_task`` stays None: tested above), and the
    rest is uvicorn's error and upgrade handling, which ours does its own way (400 through
    ``_refuse_head``; upgrades ignored)."""
    assert _self_attributes(HttpToolsProtocol.data_received) == {
        "_unset_keepalive_if_required", "parser", "logger", "send_400_response",
        "_should_upgrade", "handle_websocket_upgrade", "_unsupported_upgrade_warning"}


def test_uvicorn_reads_of_a_prediction_cycle_are_in_its_slots() -> None:
    """While a prediction is answered, ``cycle`` is a ``_Prediction``: uvicorn's
    ``on_headers_complete`` (a request pipelined behind it), ``shutdown`` and
    ``on_response_complete`` may see it and must use only what it has."""
    slots = set(_Prediction.__slots__)
    existing = _attributes_of(HttpToolsProtocol.on_headers_complete, "existing_cycle")
    assert existing == {"response_complete"}
    assert _attributes_of(HttpToolsProtocol.shutdown, "self.cycle") == {
        "response_complete", "keep_alive"}
    assert _attributes_of(HttpToolsProtocol.on_response_complete, "self.cycle") == set()
    assert existing | {"response_complete", "keep_alive"} <= slots


def test_connection_lost_touches_a_cycle_a_prediction_lacks() -> None:
    """Why fast.py's ``connection_lost`` takes a prediction out of ``cycle`` before calling
    uvicorn's: uvicorn's sets ``disconnected`` and wakes ``message_event``, which only an ASGI
    cycle has."""
    touched = _attributes_of(HttpToolsProtocol.connection_lost, "self.cycle")
    assert touched == {"response_complete", "disconnected", "message_event"}
    assert not {"disconnected", "message_event"} & set(_Prediction.__slots__)


def test_a_request_behind_an_unanswered_prediction_waits_in_the_pipeline(
        loop: asyncio.AbstractEventLoop) -> None:
    """fast.py sends a request that arrives while a prediction is unanswered the ASGI way;
    uvicorn queues it (``pipeline``) and stops reading, and at shutdown marks the prediction
    to close (``keep_alive``)."""
    protocol = _protocol(loop)
    transport = _Transport()
    protocol.connection_made(transport)
    prediction = _Prediction({}, True, None)  # type: ignore[arg-type]
    protocol.cycle = prediction  # type: ignore[assignment]
    protocol.parser.feed_data(b"GET /ping HTTP/1.1\r\nHost: test\r\n\r\n")
    assert len(protocol.pipeline) == 1
    queued, _app = protocol.pipeline[0]
    assert isinstance(queued, RequestResponseCycle) and protocol.cycle is queued
    assert not transport.reading
    protocol.cycle = prediction  # type: ignore[assignment]
    protocol.shutdown()
    assert prediction.keep_alive is False and not transport.closed


def test_on_response_complete_pieces_protocol_py_uses() -> None:
    """protocol.py replaces ``on_response_complete`` (no keep-alive timer per response): it
    counts ``server_state.total_requests``, resumes reading with ``flow``, starts the next
    pipelined request with ``_start_asgi_task(cycle, app)``, and reads
    ``timeout_keep_alive``; uvicorn's own version does no more than that and the timer."""
    source = inspect.getsource(HttpToolsProtocol.on_response_complete)
    for piece in ("self.server_state.total_requests += 1", "self.transport.is_closing()",
                  "self._unset_keepalive_if_required()", "self.flow.resume_reading()",
                  "self.pipeline.pop()", "self._start_asgi_task(cycle, app)",
                  "self.loop.call_later(", "self.timeout_keep_alive,",
                  "self.timeout_keep_alive_handler"):
        assert piece in source, piece
    calls = {ast.unparse(node.func) for node in ast.walk(_tree(
        HttpToolsProtocol.on_response_complete)) if isinstance(node, ast.Call)}
    assert calls == {"self.transport.is_closing", "self._unset_keepalive_if_required",
                     "self.flow.resume_reading", "self.pipeline.pop",
                     "self._start_asgi_task", "self.loop.call_later"}


def test_our_response_completion_arms_no_timer_and_reads_on() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        protocol = PredictionsProtocol(config=uvicorn_config(_asgi_app, PredictionsProtocol),
                                       server_state=ServerState(), app_state={}, _loop=loop)
        transport = _Transport()
        protocol.connection_made(transport)
        protocol.flow.pause_reading()
        protocol.on_response_complete()
        assert transport.reading
        assert protocol.server_state.total_requests == 1
        assert protocol.timeout_keep_alive_task is None  # the connection's own timer closes it
        assert protocol.timeout_keep_alive == 5.0  # uvicorn_config's default
        protocol.connection_lost(None)

    asyncio.run(scenario())


# -- RequestResponseCycle (fast.py, streamed answers) -----------------------------------------


def test_request_response_cycle_takes_what_fast_py_passes() -> None:
    """fast.py's ``_stream`` builds one with exactly these keywords."""
    parameters = _parameters(RequestResponseCycle.__init__)
    assert parameters == ["self", "scope", "transport", "flow", "logger", "access_logger",
                          "access_log", "default_headers", "message_event",
                          "expect_100_continue", "keep_alive", "on_response"]
    calls = [node for node in ast.walk(_tree(PredictionsProtocol._stream))
             if isinstance(node, ast.Call) and ast.unparse(node.func) == "RequestResponseCycle"]
    assert len(calls) == 1
    assert {keyword.arg for keyword in calls[0].keywords} == set(parameters[1:])


def test_request_response_cycle_writes_a_stream_chunked() -> None:
    """fast.py streams through ``RequestResponseCycle.send`` and stops writing by setting
    ``disconnected``; an invalid header is refused before anything is written."""

    async def scenario() -> None:
        def writer(transport: _Transport, done: list[bool]) -> RequestResponseCycle:
            return RequestResponseCycle(
                scope={"method": "POST"},  # type: ignore[typeddict-item]  # all send reads
                transport=transport,
                flow=FlowControl(transport), logger=logging.getLogger("test"),
                access_logger=logging.getLogger("test"), access_log=False,
                default_headers=[], message_event=asyncio.Event(),
                expect_100_continue=False, keep_alive=False,
                on_response=lambda: done.append(True))

        start = {"type": "http.response.start", "status": 200,
                 "headers": [(b"content-type", b"application/json"), (b"x-request-id", b"id")]}
        transport = _Transport()
        done: list[bool] = []
        cycle = writer(transport, done)
        await cycle.send(start)  # type: ignore[arg-type]
        await cycle.send({"type": "http.response.body", "body": b"one", "more_body": True})
        await cycle.send({"type": "http.response.body", "body": b"", "more_body": False})
        assert bytes(transport.written) == (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-request-id: id\r\n"
            b"connection: close\r\ntransfer-encoding: chunked\r\n\r\n"
            b"3\r\none\r\n0\r\n\r\n")
        assert cycle.response_complete and transport.closed and done == [True]

        transport, done = _Transport(), []
        cycle = writer(transport, done)
        cycle.disconnected = True
        await cycle.send(start)  # type: ignore[arg-type]
        assert transport.written == b""

        transport, done = _Transport(), []
        cycle = writer(transport, done)
        with pytest.raises(RuntimeError, match="header"):
            await cycle.send({"type": "http.response.start", "status": 200,
                              "headers": [(b"content-type", b"a\r\nb: c")]})
        assert transport.written == b""

    asyncio.run(scenario())


def test_request_response_cycle_sends_no_content_for_head() -> None:
    """common.HeadAsGet shows the apps GET and leaves the body to uvicorn: for a HEAD
    request's scope the cycle writes the status and headers, Content-Length as the app gave
    it, and none of the body's bytes; the response is complete and the connection kept."""

    async def scenario() -> None:
        transport = _Transport()
        done: list[bool] = []
        cycle = RequestResponseCycle(
            scope={"method": "HEAD"},  # type: ignore[typeddict-item]  # all send reads
            transport=transport, flow=FlowControl(transport),
            logger=logging.getLogger("test"), access_logger=logging.getLogger("test"),
            access_log=False, default_headers=[], message_event=asyncio.Event(),
            expect_100_continue=False, keep_alive=True, on_response=lambda: done.append(True))
        await cycle.send({"type": "http.response.start", "status": 200,  # type: ignore[arg-type]
                          "headers": [(b"content-type", b"text/plain"),
                                      (b"content-length", b"5")]})
        await cycle.send({"type": "http.response.body", "body": b"hello"})  # type: ignore[arg-type]
        assert bytes(transport.written) == (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 5\r\n\r\n")
        assert cycle.response_complete and not transport.closed and done == [True]

    asyncio.run(scenario())


# -- Config, Server, lifespan (app.py) ----------------------------------------------------------


def test_our_config_gives_the_settings_the_protocols_assume() -> None:
    """app.py's ``uvicorn_config``: our protocol class as is, no WebSocket protocol (so an
    Upgrade is never performed), lifespan off, no root path or concurrency limit (the fast
    path applies neither), no default headers (the fast path writes none), the app unwrapped."""
    protocol = protocol_for(None, 30.0, lambda status: None)
    config = uvicorn_config(_asgi_app, protocol)
    assert config.loaded
    assert config.http_protocol_class is protocol
    assert config.ws_protocol_class is None
    assert config.lifespan_class is LifespanOff
    assert config.root_path == "" and config.limit_concurrency is None
    assert config.encoded_headers == []
    assert config.loaded_app is _asgi_app
    assert config.timeout_graceful_shutdown == GRACEFUL_SHUTDOWN_S


def test_server_startup_needs_only_the_lifespan_serve_would_create() -> None:
    """app.py creates ``server.lifespan`` as ``Server._serve`` does, then awaits
    ``startup(sockets=...)``, and at the end ``shutdown(sockets=...)``."""
    assert "self.lifespan = config.lifespan_class(config)" in inspect.getsource(
        uvicorn.Server._serve)
    assert "lifespan" in _self_attributes(uvicorn.Server.startup)
    assert "lifespan" not in _self_attributes(uvicorn.Server.__init__)
    for method in (uvicorn.Server.startup, uvicorn.Server.shutdown):
        assert inspect.iscoroutinefunction(method)
        assert _parameters(method) == ["self", "sockets"]
    assert _parameters(uvicorn.Server.__init__) == ["self", "config"]
    lifespan = LifespanOff(uvicorn_config(_asgi_app, HttpToolsProtocol))
    assert lifespan.should_exit is False and lifespan.state == {}
    assert inspect.iscoroutinefunction(lifespan.startup)
    assert inspect.iscoroutinefunction(lifespan.shutdown)


def test_server_state_holds_what_protocols_and_shutdown_share() -> None:
    """``Server.shutdown`` asks every connection in ``connections`` to finish and waits for
    ``tasks``; fast.py passes ``default_headers`` to its stream writer."""
    state = ServerState()
    assert state.connections == set() and state.tasks == set()
    assert state.default_headers == [] and state.total_requests == 0
    assert {"connections", "tasks"} <= _attributes_of(uvicorn.Server._wait_tasks_to_complete,
                                                       "self.server_state")


# -- httptools (protocol.py, fast.py) -----------------------------------------------------------


def test_the_httptools_parser_interface() -> None:
    """The parser calls protocol.py and fast.py make, and the exceptions protocol.py handles:
    ``HttpParserUpgrade.args[0]`` is where the bytes after an upgrade request's head begin."""
    for method in ("feed_data", "get_method", "get_http_version", "should_keep_alive",
                   "should_upgrade", "set_dangerous_leniencies"):
        assert callable(getattr(httptools.HttpRequestParser, method)), method
    assert issubclass(httptools.HttpParserCallbackError, httptools.HttpParserError)
    url = httptools.parse_url(b"/predictions/a%20b?x=1")
    assert (url.path, url.query) == (b"/predictions/a%20b", b"x=1")

    class Callbacks:
        pass

    parser = httptools.HttpRequestParser(Callbacks())
    data = (b"POST / HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"
            b"Content-Length: 3\r\n\r\nabc")
    with pytest.raises(httptools.HttpParserUpgrade) as upgrade:
        parser.feed_data(data)
    assert data[upgrade.value.args[0]:] == b"abc"
    assert (parser.get_method(), parser.get_http_version()) == (b"POST", "1.1")
    assert parser.should_upgrade() and parser.should_keep_alive()
