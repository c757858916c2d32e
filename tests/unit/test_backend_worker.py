"""The real worker process (``python -m backend``) against a Unix socket this test listens on."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from google.protobuf.message import Message

from protos import worker_pb2
from protos.framing import Frame, FrameDecoder, Kind, encode

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "handlers"
TIMEOUT_S = 10.0  # upper bound for any single step; a healthy worker answers in milliseconds
EXIT_DEADLINE_S = 5.0


@dataclass
class Connection:
    """The frontend's end of one worker connection."""

    sock: socket.socket
    decoder: FrameDecoder = field(default_factory=FrameDecoder)
    pending: list[Frame] = field(default_factory=list)

    def send(self, kind: Kind, message: Message | None = None) -> None:
        payload = message.SerializeToString() if message is not None else b""
        self.sock.sendall(encode(Frame(kind, payload)))

    def receive(self) -> Frame:
        while not self.pending:
            data = self.sock.recv(1 << 16)
            if not data:
                raise EOFError("the worker closed the connection")
            self.pending.extend(self.decoder.feed(data))
        return self.pending.pop(0)

    def is_closed_by_peer(self) -> bool:
        """Wait (up to the socket timeout) for the worker to close its end."""
        try:
            return self.sock.recv(1 << 16) == b""
        except ConnectionResetError:
            return True


@pytest.fixture
def socket_path() -> Iterator[str]:
    # Unix socket paths are limited to ~100 bytes: pytest's tmp_path can be too long.
    directory = tempfile.mkdtemp(prefix="bs-", dir="/tmp")
    try:
        yield os.path.join(directory, "w.sock")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def listener(socket_path: str) -> Iterator[socket.socket]:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path)
    server.listen(1)
    server.settimeout(TIMEOUT_S)
    with server:
        yield server


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    for name in ("echo.py", "raises.py", "sleep.py"):
        shutil.copy(FIXTURES / name, directory / name)
    return directory


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Every process a test starts; killed at the end if still running."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=TIMEOUT_S)


def start_worker(
    socket_path: str, listener: socket.socket, processes: list[subprocess.Popen[bytes]]
) -> tuple[subprocess.Popen[bytes], Connection]:
    process = subprocess.Popen([sys.executable, "-m", "backend", "--socket", socket_path], cwd=REPO)
    processes.append(process)
    sock, _ = listener.accept()
    sock.settimeout(TIMEOUT_S)
    return process, Connection(sock)


def hello_and_load(conn: Connection, model_dir: Path, handler: str = "echo.py") -> Frame:
    hello = conn.receive()
    assert hello.kind is Kind.HELLO
    assert worker_pb2.Hello.FromString(hello.payload).pid > 0
    conn.send(
        Kind.LOAD,
        worker_pb2.LoadModel(
            model_name="toy",
            model_dir=str(model_dir),
            handler=handler,
            batch_size=4,
            gpu_id=-1,
            manifest_json="{}",
            decode_input_request=True,
        ),
    )
    return conn.receive()


def predict_batch(batch_id: int, *bodies: bytes) -> worker_pb2.PredictBatch:
    return worker_pb2.PredictBatch(
        batch_id=batch_id,
        requests=[
            worker_pb2.Request(request_id=f"req-{i}", inputs={"body": body})
            for i, body in enumerate(bodies)
        ],
    )


def assert_exits_zero(process: subprocess.Popen[bytes]) -> None:
    assert process.wait(timeout=EXIT_DEADLINE_S) == 0


def test_load_predict_shutdown(
    socket_path: str,
    listener: socket.socket,
    model_dir: Path,
    processes: list[subprocess.Popen[bytes]],
) -> None:
    process, conn = start_worker(socket_path, listener, processes)

    loaded = hello_and_load(conn, model_dir)
    assert loaded.kind is Kind.LOADED, worker_pb2.Error.FromString(loaded.payload)
    assert worker_pb2.Loaded.FromString(loaded.payload).load_time_ms >= 0

    conn.send(Kind.PREDICT, predict_batch(41, b"one", b"two"))
    reply = conn.receive()
    assert reply.kind is Kind.PREDICTED
    result = worker_pb2.PredictResult.FromString(reply.payload)
    assert result.batch_id == 41
    assert [(r.request_id, r.status, r.body) for r in result.responses] == [
        ("req-0", 200, b"one"),
        ("req-1", 200, b"two"),
    ]

    conn.send(Kind.SHUTDOWN)
    assert_exits_zero(process)
    conn.sock.close()


def test_load_failure_is_reported_and_the_worker_waits(
    socket_path: str,
    listener: socket.socket,
    model_dir: Path,
    processes: list[subprocess.Popen[bytes]],
) -> None:
    process, conn = start_worker(socket_path, listener, processes)

    reply = hello_and_load(conn, model_dir, handler="missing.py")

    assert reply.kind is Kind.ERROR
    error = worker_pb2.Error.FromString(reply.payload)
    assert error.code == worker_pb2.LOAD_FAILED
    assert error.message.startswith("HandlerLoadError: handler 'missing.py': no file 'missing.py'")
    assert process.poll() is None  # the frontend decides what happens next

    conn.sock.close()
    assert_exits_zero(process)


def test_closing_the_socket_stops_the_worker(
    socket_path: str,
    listener: socket.socket,
    model_dir: Path,
    processes: list[subprocess.Popen[bytes]],
) -> None:
    process, conn = start_worker(socket_path, listener, processes)
    assert hello_and_load(conn, model_dir).kind is Kind.LOADED

    conn.sock.close()

    assert_exits_zero(process)


def test_batch_failure_is_an_error_frame_and_the_worker_keeps_serving(
    socket_path: str,
    listener: socket.socket,
    model_dir: Path,
    processes: list[subprocess.Popen[bytes]],
) -> None:
    process, conn = start_worker(socket_path, listener, processes)
    assert hello_and_load(conn, model_dir, handler="raises.py").kind is Kind.LOADED

    for batch_id, body, code, message in [
        (1, b"x", worker_pb2.INTERNAL, "RuntimeError: boom"),
        (2, b"invalid", worker_pb2.INVALID_INPUT, "the input is not a picture of a cat"),
    ]:
        conn.send(Kind.PREDICT, predict_batch(batch_id, body))
        reply = conn.receive()
        assert reply.kind is Kind.ERROR
        error = worker_pb2.Error.FromString(reply.payload)
        assert (error.code, error.message, error.batch_id) == (code, message, batch_id)

    assert process.poll() is None
    conn.sock.close()
    assert_exits_zero(process)


def test_unexpected_frames_get_protocol_errors(
    socket_path: str,
    listener: socket.socket,
    model_dir: Path,
    processes: list[subprocess.Popen[bytes]],
) -> None:
    process, conn = start_worker(socket_path, listener, processes)
    assert conn.receive().kind is Kind.HELLO

    conn.send(Kind.PREDICT, predict_batch(5, b"too early"))
    early = worker_pb2.Error.FromString(conn.receive().payload)
    conn.send(Kind.LOADED, worker_pb2.Loaded())
    wrong_way = worker_pb2.Error.FromString(conn.receive().payload)

    assert (early.code, early.batch_id) == (worker_pb2.PROTOCOL, 5)
    assert "before a model was loaded" in early.message
    assert (wrong_way.code, wrong_way.message) == (worker_pb2.PROTOCOL, "unexpected frame LOADED")
    conn.sock.close()
    assert_exits_zero(process)


def test_bytes_that_are_not_frames_end_the_connection(
    socket_path: str,
    listener: socket.socket,
    processes: list[subprocess.Popen[bytes]],
) -> None:
    process, conn = start_worker(socket_path, listener, processes)
    assert conn.receive().kind is Kind.HELLO

    conn.sock.sendall(b"GET / HTTP/1.1\r\n\r\n")

    reply = conn.receive()
    assert reply.kind is Kind.ERROR
    assert worker_pb2.Error.FromString(reply.payload).code == worker_pb2.PROTOCOL
    assert process.wait(timeout=EXIT_DEADLINE_S) == 2
    conn.sock.close()


def test_worker_exits_when_its_parent_is_killed(
    socket_path: str,
    listener: socket.socket,
    model_dir: Path,
    processes: list[subprocess.Popen[bytes]],
) -> None:
    # A stand-in frontend process starts the worker; the test keeps the socket open, so only
    # the watchdog can notice that the parent died while the handler sleeps.
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; subprocess.Popen(sys.argv[1:]).wait()",
            sys.executable,
            "-m",
            "backend",
            "--socket",
            socket_path,
        ],
        cwd=REPO,
    )
    processes.append(parent)
    sock, _ = listener.accept()
    sock.settimeout(TIMEOUT_S)
    conn = Connection(sock)
    hello = conn.receive()
    worker_pid = worker_pb2.Hello.FromString(hello.payload).pid
    try:
        conn.send(
            Kind.LOAD,
            worker_pb2.LoadModel(
                model_name="toy", model_dir=str(model_dir), handler="sleep.py", gpu_id=-1
            ),
        )
        assert conn.receive().kind is Kind.LOADED
        conn.send(Kind.PREDICT, predict_batch(1, b"60"))

        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=TIMEOUT_S)
        start = time.monotonic()

        conn.sock.settimeout(EXIT_DEADLINE_S)
        assert conn.is_closed_by_peer()
        assert time.monotonic() - start < EXIT_DEADLINE_S
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker_pid, signal.SIGKILL)  # do not leave an orphan behind
        raise
    finally:
        conn.sock.close()


def test_worker_modules_do_not_import_torch() -> None:
    code = (
        "import sys, backend.__main__, backend.process.worker, backend.service.model_service,"
        " backend.service.loader;"
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60).returncode == 0


def test_batches_sent_back_to_back_are_answered_in_order(
    socket_path: str, listener: socket.socket, model_dir: Path, processes: list
) -> None:
    # The frontend sends a second batch while the first runs (two in flight): the worker
    # reads it ahead and answers both, in the order they came.
    process, conn = start_worker(socket_path, listener, processes)
    assert hello_and_load(conn, model_dir, "sleep.py").kind is Kind.LOADED
    conn.send(Kind.PREDICT, predict_batch(1, b"0.3", b"a"))
    conn.send(Kind.PREDICT, predict_batch(2, b"b", b"c"))
    conn.send(Kind.PREDICT, predict_batch(3, b"d"))
    replies = [conn.receive() for _ in range(3)]
    assert [frame.kind for frame in replies] == [Kind.PREDICTED] * 3
    results = [worker_pb2.PredictResult.FromString(frame.payload) for frame in replies]
    assert [result.batch_id for result in results] == [1, 2, 3]
    assert [r.body for r in results[1].responses] == [b"b", b"c"]
    conn.send(Kind.SHUTDOWN)
    assert_exits_zero(process)
    conn.sock.close()


def test_each_frame_is_decoded_once_into_a_command() -> None:
    """The reader thread's decoding (no process needed): every payload is decoded there, and
    what cannot be obeyed becomes a Bad command the main thread answers."""
    from backend.process.worker import Bad, Load, Predict, Shutdown, WorkerSession

    left, right = socket.socketpair()
    with left, right:
        session = WorkerSession(left)
        batch = worker_pb2.PredictBatch(batch_id=7, requests=[worker_pb2.Request(request_id="r")])
        predict = session.command(Frame(Kind.PREDICT, batch.SerializeToString()))
        assert predict == Predict(batch, None)  # no model yet: it runs unprepared
        load = worker_pb2.LoadModel(model_name="m")
        assert session.command(Frame(Kind.LOAD, load.SerializeToString())) == Load(load)
        assert session.command(Frame(Kind.SHUTDOWN, b"")) == Shutdown()
        for kind in (Kind.PREDICT, Kind.LOAD):
            bad = session.command(Frame(kind, b"\xff\xff\xff"))
            assert isinstance(bad, Bad) and f"bad {kind.name} payload" in bad.message
        assert session.command(Frame(Kind.HELLO, b"")) == Bad("unexpected frame HELLO")
        refused = session.obey(predict)
        assert refused is not None and refused.kind is Kind.ERROR
        error = worker_pb2.Error.FromString(refused.payload)
        assert (error.code, error.batch_id) == (worker_pb2.PROTOCOL, 7)
        assert session.obey(Shutdown()) is None and session.should_stop
