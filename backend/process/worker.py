"""The worker process: connect to the frontend, load one model, answer batches until told to stop.

Protocol (frames of ``protos.framing`` carrying ``protos.worker_pb2`` messages)::

    worker -> HELLO(Hello)
    frontend -> LOAD(LoadModel)       worker -> LOADED(Loaded) | ERROR(LOAD_FAILED)
    frontend -> PREDICT(PredictBatch) worker -> PREDICTED(PredictResult) | ERROR(code)
    frontend -> SHUTDOWN, or closes the socket: the worker exits 0

Every frame from the frontend gets exactly one reply, except SHUTDOWN, in the order the
frames came. The frontend may send a batch while the worker still runs the one before it: a
reader thread takes frames off the socket as they arrive and, for a handler that can
(``ModelService.prepare``: the vision handlers decode their images), prepares the next batch
while the main thread runs the current one; replies are written by the main thread only.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import select
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# NOTE: every module the worker needs is imported here, before a model directory joins
# sys.path (STYLE trap 22), so nothing in an archive can shadow them.
from backend.compat import install_torchserve_shim
from backend.errors import classify, describe
from backend.service.model_service import ModelService, encode_result, load_service
from protos import worker_pb2
from protos.framing import MAX_PAYLOAD_BYTES, Frame, FrameDecoder, Kind, ProtocolError, encode

#: The modules a worker has imported once this module is (these, what they import, the
#: interpreter's own): what a fresh worker holds before a model's folder joins sys.path. A
#: forked worker keeps them too; the fork server's others it drops where its archive shadows
#: them (backend/process/shadowing.py).
STARTUP_MODULES = frozenset(sys.modules)

logger = logging.getLogger("backend.process.worker")

RECV_BYTES = 1 << 20
#: Frames read (and batches prepared) ahead of the one being run: the frontend holds at most
#: two batches in flight on a worker.
READ_AHEAD = 2
WATCHDOG_INTERVAL_S = 0.25
#: TorchServe's worker's: the message alone, on stdout (the frontend's model log adds the
#: time, the level and the worker's name to each line, as TorchServe's frontend does).
LOG_FORMAT = "%(message)s"


@dataclass(frozen=True, slots=True)
class Load:
    """LOAD: load this model."""

    message: worker_pb2.LoadModel


@dataclass(frozen=True, slots=True)
class Predict:
    """PREDICT: run this batch; ``prepared`` is what the handler did ahead (None: nothing)."""

    batch: worker_pb2.PredictBatch
    prepared: Any = None


@dataclass(frozen=True, slots=True)
class Shutdown:
    """SHUTDOWN: exit once the batch being run is answered."""


@dataclass(frozen=True, slots=True)
class Bad:
    """A frame that cannot be obeyed: answered with this error."""

    message: str
    batch_id: int = 0


Command = Load | Predict | Shutdown | Bad


class WorkerSession:
    """One worker's connection to the frontend: no model yet, or one loaded ModelService.

    A reader thread decodes each frame once into a ``Command`` (a PREDICT's batch is also
    prepared there, while the main thread runs the batch before it); the main thread obeys
    the commands in order."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._decoder = FrameDecoder()
        self.service: ModelService | None = None
        self.should_stop = False

    def serve(self) -> None:
        """Say HELLO, then obey commands until SHUTDOWN or the frontend closes the socket."""
        self._send(Frame(Kind.HELLO, worker_pb2.Hello(pid=os.getpid()).SerializeToString()))
        inbox: queue.Queue[Command | ProtocolError | None] = queue.Queue(READ_AHEAD)
        threading.Thread(target=self._read, args=(inbox,), name="frame-reader",
                         daemon=True).start()
        while not self.should_stop:
            item = inbox.get()
            if item is None:
                logger.info("frontend closed the connection; exiting")
                return
            if isinstance(item, ProtocolError):
                # The stream cannot be resynchronised: say why, then give up the connection.
                self._send(error_frame(worker_pb2.PROTOCOL, str(item)))
                raise item
            reply = self.obey(item)
            if reply is not None:
                self._send(reply)
            if self.should_stop:
                logger.info("shutdown requested; exiting")
                return

    def _read(self, inbox: queue.Queue[Command | ProtocolError | None]) -> None:
        """The reader thread: frames off the socket, in order, each decoded into a command;
        None at end of file."""
        # Read into one buffer made once: recv(n) would allocate n bytes for every read
        # (a 1 MiB mapping, ~13 µs, for a 1 KB frame).
        received = bytearray(RECV_BYTES)
        try:
            with memoryview(received) as view:
                while size := self._sock.recv_into(received):
                    for frame in self._decoder.feed(view[:size]):
                        inbox.put(self.command(frame))
        except ProtocolError as exc:
            inbox.put(exc)
            return
        except OSError:
            pass  # the socket was closed under us: the main thread is exiting
        inbox.put(None)

    def command(self, frame: Frame) -> Command:
        """What ``frame`` asks, decoded (the one place a payload is decoded)."""
        if frame.kind is Kind.SHUTDOWN:
            return Shutdown()
        if frame.kind is Kind.LOAD:
            try:
                return Load(worker_pb2.LoadModel.FromString(frame.payload))
            except Exception as exc:  # protobuf's DecodeError
                return Bad(f"bad LOAD payload: {describe(exc)}")
        if frame.kind is not Kind.PREDICT:
            return Bad(f"unexpected frame {frame.kind.name}")
        try:
            batch = worker_pb2.PredictBatch.FromString(frame.payload)
        except Exception as exc:  # protobuf's DecodeError
            return Bad(f"bad PREDICT payload: {describe(exc)}")
        return Predict(batch, self._prepare(batch))

    def _prepare(self, batch: worker_pb2.PredictBatch) -> Any:
        """The handler's work ahead on ``batch`` (None: none, or no model loaded yet: a batch
        read behind its LOAD runs unprepared)."""
        if self.service is None:
            return None
        try:
            return self.service.prepare(batch)
        except Exception:  # whatever went wrong, the batch runs the plain way and says why
            logger.exception("preparing batch %d failed; running it unprepared", batch.batch_id)
            return None

    def obey(self, command: Command) -> Frame | None:
        """The reply to one command (None for SHUTDOWN)."""
        match command:
            case Shutdown():
                self.should_stop = True
                return None
            case Load(message):
                return self._load(message)
            case Predict(batch, prepared):
                return self._predict(batch, prepared)
            case Bad(message, batch_id):
                return error_frame(worker_pb2.PROTOCOL, message, batch_id)
        raise AssertionError(f"unknown command {command!r}")

    def _load(self, message: worker_pb2.LoadModel) -> Frame:
        if self.service is not None:
            return error_frame(
                worker_pb2.PROTOCOL,
                f"model {self.service.context.model_name!r} is already loaded",
            )
        logger.info(
            "loading model %s (version %s) from %s with handler %r",
            message.model_name,
            message.model_version or "-",
            message.model_dir,
            message.handler,
        )
        start = time.perf_counter()
        try:
            self.service = load_service(message)
            self.service.context.partial_sink = self._send_partial
        except Exception as exc:
            logger.exception("loading model %s failed", message.model_name)
            return error_frame(worker_pb2.LOAD_FAILED, describe(exc))
        load_time_ms = (time.perf_counter() - start) * 1000.0
        execution = self.service.context.execution
        logger.info("model %s loaded in %.1f ms%s", message.model_name, load_time_ms,
                    describe_execution(execution))
        loaded = worker_pb2.Loaded(load_time_ms=load_time_ms,
                                   metrics=self.service.drain_metrics(),
                                   execution=execution)
        return Frame(Kind.LOADED, loaded.SerializeToString())

    def _predict(self, batch: worker_pb2.PredictBatch, prepared: Any) -> Frame:
        if self.service is None:
            return error_frame(
                worker_pb2.PROTOCOL, "PREDICT before a model was loaded", batch.batch_id
            )
        try:
            result = self.service.predict(batch, prepared)
        except Exception as exc:
            code, message = classify(exc)
            if code == worker_pb2.INTERNAL or code == worker_pb2.OUT_OF_MEMORY:
                logger.exception(
                    "batch %d of %d requests failed", batch.batch_id, len(batch.requests)
                )
            else:
                logger.warning(
                    "batch %d of %d requests failed: %s",
                    batch.batch_id,
                    len(batch.requests),
                    message,
                )
            return error_frame(code, message, batch.batch_id)
        payload = result.SerializeToString()
        if len(payload) > MAX_PAYLOAD_BYTES:
            return error_frame(
                worker_pb2.INTERNAL,
                f"the results of batch {batch.batch_id} take {len(payload)} bytes, more than "
                f"a frame can carry ({MAX_PAYLOAD_BYTES})",
                batch.batch_id,
            )
        return Frame(Kind.PREDICTED, payload)

    def _send(self, frame: Frame) -> None:
        self._sock.sendall(encode(frame))

    def _send_partial(self, request_id: str, item: Any, status: int) -> None:
        body, content_type = encode_result(item)
        response = worker_pb2.Response(request_id=request_id, status=status, body=body,
                                       content_type=content_type)
        self._send(Frame(Kind.PARTIAL, response.SerializeToString()))


#: How the model log says each Execution mode (backend/handlers/graphs.py).
_MODE_WORDS = {"cuda_graphs": "as CUDA graphs", "padded": "padded, eagerly",
               "eager": "eagerly, at their own size"}


def describe_execution(execution: worker_pb2.Execution) -> str:
    """How the model runs its batches, for the model log ("" when it did not say)."""
    if not execution.mode:
        return ""
    text = f"; its batches run {_MODE_WORDS.get(execution.mode, execution.mode)}"
    if execution.batch_buckets:
        text += f" in buckets {list(execution.batch_buckets)}"
    if execution.graph_pool_bytes:
        text += f", the graphs' pool {execution.graph_pool_bytes / 2**20:.1f} MiB"
    if execution.fallback_reason:
        text += f" ({execution.fallback_reason})"
    return text


def error_frame(code: worker_pb2.ErrorCode, message: str, batch_id: int = 0) -> Frame:
    error = worker_pb2.Error(code=code, message=message, batch_id=batch_id)
    return Frame(Kind.ERROR, error.SerializeToString())


def start_parent_watchdog(parent_pid: int, interval_s: float = WATCHDOG_INTERVAL_S) -> None:
    """Exit the process as soon as the parent that started it is gone.

    A worker stuck in a long handler call never reads the socket, so it would not notice
    a SIGKILLed frontend; when the parent dies the worker is re-parented and getppid changes.
    """

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent_pid:
                os.write(2, f"parent process {parent_pid} is gone; worker exiting\n".encode())
                os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def start_pidfd_watchdog(pidfd: int, pid: int) -> None:
    """Exit the process as soon as the process behind ``pidfd`` (the frontend) is gone: the
    watchdog of a worker whose parent is not the frontend (a fork server's child), for the
    reason ``start_parent_watchdog`` gives. A pidfd names that process alone, even once its
    pid is reused."""

    def watch() -> None:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        while not poller.poll():
            pass
        os.write(2, f"frontend process {pid} is gone; worker exiting\n".encode())
        os._exit(1)

    threading.Thread(target=watch, name="frontend-watchdog", daemon=True).start()


class _OneLineRecord(logging.LogRecord):
    """A log record whose unprintable characters are escaped: a request's name or text in a
    message cannot start a forged line of the model log, which is this process's stdout
    (the frontend escapes each line it forwards too; a traceback keeps its lines)."""

    def getMessage(self) -> str:
        message = super().getMessage()
        if message.isprintable():
            return message
        return "".join(char if char.isprintable() else ascii(char)[1:-1] for char in message)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m backend", description="Run one batchserve backend worker."
    )
    parser.add_argument("--socket", required=True, help="Unix socket the frontend listens on")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one worker; the exit status is 0 on SHUTDOWN or EOF."""
    parent_pid = os.getppid()
    args = parse_args(argv)
    configure_output()
    start_parent_watchdog(parent_pid)
    return run(args.socket)


def configure_output() -> None:
    """The worker's log lines on stdout, as TorchServe's worker writes them, one record a
    line; print() line-buffered: the frontend reads stdout and stderr through pipes, and a
    line must not sit in a block buffer until exit."""
    logging.setLogRecordFactory(_OneLineRecord)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stdout)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)


def run(socket_path: str) -> int:
    """Connect to the frontend at ``socket_path`` and serve it until SHUTDOWN or EOF (0), or
    a broken protocol or a socket that cannot be reached (2)."""
    # Unmodified TorchServe handlers `import ts`: without a real TorchServe they get our shim.
    if install_torchserve_shim():
        logger.info("`import ts` resolves to batchserve's TorchServe shim")

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_path)
    except OSError as exc:
        logger.error("cannot connect to %s: %s", socket_path, exc)
        sock.close()
        return 2
    # A child the handler forks (multiprocessing, DataLoader workers) must not keep the
    # frontend's socket open: the frontend would not see this worker die. (Exec'd children
    # never get it: Python's sockets are close-on-exec.)
    os.register_at_fork(after_in_child=sock.close)
    with sock:
        try:
            WorkerSession(sock).serve()
        except (BrokenPipeError, ConnectionResetError):
            logger.info("frontend went away; exiting")
        except ProtocolError as exc:
            logger.error("protocol error, closing the connection: %s", exc)
            return 2
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
