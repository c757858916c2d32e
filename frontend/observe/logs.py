r"""Log files, as TorchServe's default log4j2 configuration writes them, in ``log_location``:
``ts_log.log`` (the server's log, the console's lines when ``--foreground``: ``cli.py``),
``access_log.log`` (one line per request, written in bulk off the hot path),
``model_log.log`` (the workers' output, a line each), and the two metric logs
(``metric_log.py``). Each line has TorchServe's form (its ``log4j2.xml``)::

    ts_log.log, console: %d{ISO8601} [%-5p] %t %c - %m%n
        2026-11-27T13:47:01,120 [INFO ] MainThread frontend.server - Model server started...
    access_log.log:      %d{ISO8601} - %m%n
        2026-11-27T13:47:05,107 - /127.0.0.1:46924 "GET /models HTTP/1.1" 200 3
    model_log.log:       %d{ISO8601} [%-5p] %t %c - %m%n
        2026-11-27T13:47:04,311 [INFO ] W-9000-mnist_1.0-stdout MODEL_LOG - loaded

An access line's message is TorchServe's (its ``Session``): the client's address, the request
line, the status and the whole time in ms; over gRPC ``"gRPC <service>/<method> HTTP/2.0"``
and the gRPC status code. ``access_log_extended=true`` adds batchserve's fields to a
prediction's line (``AccessLog``). A worker's stdout lines are INFO, its stderr lines WARN,
each under the name of TorchServe's reader thread (``W-<port>-<model>_<version>-stdout``).

A logging configuration may name these logs instead (TorchServe's log4j2 file, ``log4j.py``):
then they are written through the Python loggers of TorchServe's names, ``ACCESS_LOG`` and
``MODEL_LOG``, whose handlers that configuration chose.

The request path only appends a tuple to a list; the event loop formats and writes the
collected lines every 0.2 s in one write. (TorchServe's default logging costs it half its
echo throughput; benchmarks/RESULTS.md has ours with the access log on and off.)

No byte a client sends reaches a log as it came: a path, a model name, a header may hold a
CR/LF (``%0d%0a`` decoded) that would start a forged line, or an ESC that drives a terminal.
Every field of an access-log line, every line of a worker's output and every message of the
server log (``EscapingLogRecord``) has its unprintable characters written as ``\xNN`` /
``\uNNNN`` escapes (``escape``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TextIO, cast

from frontend.errors import grpc_code
from frontend.observe.events import WORKFLOW_VERSION, Batch, CallFacts
from frontend.observe.log4j_pattern import translate
from frontend.observe.timing import log_fields

#: TorchServe's file names (its log4j2.xml's appenders).
SERVER_LOG = "ts_log.log"
ACCESS_LOG = "access_log.log"
MODEL_LOG = "model_log.log"
#: TorchServe's layout of its server log, its console and its model log.
SERVER_PATTERN = "%d{ISO8601} [%-5p] %t %c - %m%n"
#: TorchServe's loggers of the access log and of its workers' output (log4j2 names).
TS_ACCESS_LOGGER = "ACCESS_LOG"
TS_MODEL_LOGGER = "MODEL_LOG"
#: The parent of every server's model logger (a child per server, so that two servers in
#: one process write their workers' output to their own model_log.log).
MODEL_LOGGER = "batchserve.model"
FLUSH_INTERVAL_S = 0.2
#: Entries after which the log is flushed at once (each flush formats them on the event loop:
#: about a millisecond for this many).
FLUSH_ENTRIES = 256
#: An access line's message: TorchServe's (client, request line, status, whole ms).
_ENTRY = '%s "%s %s %s" %d %d'
#: A prediction's message with ``access_log_extended=true`` (then its phases).
_EXTENDED_ENTRY = f"{_ENTRY} model=%s version=%s queue_ms=%.2f batch=%d"
#: Where a record's relativeCreated counts from (logging's own start time).
_START_TIME: float = getattr(logging, "_startTime", time.time())


def pattern_handler(handler: logging.Handler, pattern: str = SERVER_PATTERN
                    ) -> logging.Handler:
    """``handler`` writing log4j2's ``pattern`` (by default TorchServe's server-log layout)."""
    translation = translate(pattern)
    handler.setFormatter(translation.formatter)
    if isinstance(handler, logging.StreamHandler):
        handler.terminator = translation.terminator
    return handler


class Iso8601:
    """log4j's ``%d{ISO8601}`` (``2026-11-27T13:47:05,107``, local time) of a Unix time; the
    part to the second made once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._text = ""

    def __call__(self, seconds: float) -> str:
        whole = int(seconds)
        if whole != self._second:
            self._second = whole
            self._text = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(whole))
        return f"{self._text},{int((seconds - whole) * 1000):03d}"


def log_output(model_log: logging.Logger, thread: str, text: str,
               level: int = logging.INFO) -> None:
    """One line a worker (or a helper of the server) wrote, into the model log as TorchServe's
    reader thread logs it: from the logger ``MODEL_LOG``, on the thread ``thread``
    (``W-9000-mnist_1.0-stdout``), INFO for stdout and WARN for stderr."""
    if not model_log.isEnabledFor(level):
        return
    record = model_log.makeRecord(TS_MODEL_LOGGER, level, "", 0, text, (), None)
    record.threadName = thread
    model_log.handle(record)


_GRPC_STATUS: dict[int, int] = {0: 1}  # the client left: CANCELLED


def grpc_status(http_status: int) -> int:
    """The gRPC status code of an RPC answered as ``http_status`` (what TorchServe's access
    log writes for an RPC): OK for 2xx, CANCELLED where the client left."""
    code = _GRPC_STATUS.get(http_status)
    if code is None:
        code = 0 if 200 <= http_status < 300 else int(grpc_code(http_status).value[0])
        _GRPC_STATUS[http_status] = code
    return code


def escape(text: str) -> str:
    """``text`` with every unprintable character (controls, line and paragraph separators,
    format characters such as a right-to-left override) as a Python escape; the common text
    that has none is returned as it is, after one C-speed check."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else ascii(char)[1:-1] for char in text)


async def output_lines(stream: asyncio.StreamReader) -> AsyncIterator[str]:
    """The lines a child process writes to ``stream``, decoded and escaped (``escape``),
    without their line ends. A line longer than the stream's limit (64 KiB) comes in pieces of
    that size: the pipe must never stop being read, or the child blocks on its next write."""
    while True:
        try:
            line = await stream.readuntil(b"\n")
        except asyncio.IncompleteReadError as end:  # the last line, without its newline
            line = end.partial
        except asyncio.LimitOverrunError as long:
            line = await stream.readexactly(long.consumed)
        if not line:
            return
        yield escape(line.decode("utf-8", "replace").rstrip())


class EscapingLogRecord(logging.LogRecord):
    """A log record whose message is escaped (``escape``), whatever formatter or handler
    writes it: a logged client value cannot break the line. (A traceback, added by the
    formatter, keeps its lines.) ``logging.setLogRecordFactory`` installs it for a process."""

    def getMessage(self) -> str:
        return escape(super().getMessage())


class BufferedLog:
    """A log written in one go every ``FLUSH_INTERVAL_S``: entries are collected on the
    event loop (a tuple and a list append each) and formatted when flushed; an entry is
    written at once where no loop runs. Written to the file ``path``, or, given a
    ``logger``, as one record each through that logger (its handlers format and write them,
    stamped with the entry's time)."""

    def __init__(self, path: Path | None, logger: logging.Logger | None = None) -> None:
        self.path = path
        self.logger = logger
        self._file: TextIO | None = None
        self._on = False
        #: (unix time, then the entry's fields)
        self._pending: list[tuple[Any, ...]] = []
        self._flush_handle: asyncio.Handle | None = None
        #: Each line's time, as TorchServe's layouts write it (``%d{ISO8601}``).
        self._clock = Iso8601()

    @property
    def enabled(self) -> bool:
        return self._on

    def open(self) -> None:
        if self.logger is not None:
            # Off where the configuration turns the logger off: nothing is even collected.
            self._on = self.logger.isEnabledFor(logging.INFO)
        elif self.path is not None:
            self._file = self.path.open("a", encoding="utf-8", buffering=1 << 16)
            self._on = True

    def _flush_soon(self) -> None:
        """Enough entries for one flush: written on the loop's next turn, so that a flush
        holds the loop for a bounded time however many requests a second come."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        self._flush_handle = asyncio.get_running_loop().call_soon(self.flush)

    def _added(self) -> None:
        """An entry was appended: flushed within FLUSH_INTERVAL_S, or on the loop's next turn
        once FLUSH_ENTRIES wait. (``AccessLog.write``, the hot path, has this inline.)"""
        if self._flush_handle is None:
            self._schedule()
        elif len(self._pending) == FLUSH_ENTRIES:
            self._flush_soon()

    def _schedule(self) -> None:
        """An entry was added: flush within FLUSH_INTERVAL_S (at once without a loop)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._flush_handle = loop.call_later(FLUSH_INTERVAL_S, self.flush)

    def _text(self, entries: list[tuple[Any, ...]]) -> str:
        """The entries as the file's lines."""
        raise NotImplementedError

    def _message(self, entry: tuple[Any, ...]) -> str:
        """One entry as a record's message (the logger's handlers add the time)."""
        raise NotImplementedError

    def flush(self) -> None:
        self._flush_handle = None
        if not self._on or not self._pending:
            return
        entries, self._pending = self._pending, []
        if self._file is not None:
            self._file.write(self._text(entries))
            self._file.flush()
            return
        assert self.logger is not None
        for entry in entries:
            record = self.logger.makeRecord(self.logger.name, logging.INFO, "", 0,
                                            self._message(entry), (), None)
            stamp = cast(float, entry[0])  # when it happened, not when flushed
            record.created, record.msecs = stamp, (stamp - int(stamp)) * 1000
            record.relativeCreated = (stamp - _START_TIME) * 1000
            self.logger.handle(record)

    def close(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        self.flush()
        self._on = False
        if self._file is not None:
            self._file.close()
            self._file = None


class AccessLog(BufferedLog):
    """One line per request, TorchServe's: the client, the request line, the status (over
    gRPC its code), the whole time in ms. With ``extended`` (``access_log_extended=true``) a
    prediction's line goes on with batchserve's fields: its model, version, queue wait and
    batch size, then where its time went (``timing.log_fields``: the batch's forming, the
    worker, the handler's steps, the frontend, and why its batch left the queue) unless
    ``phases`` is off (``request_phases=false``)."""

    def __init__(self, path: Path | None, logger: logging.Logger | None = None,
                 phases: bool = True, extended: bool = False) -> None:
        super().__init__(path, logger)
        self._extended = extended
        self._with_phases = extended and phases

    @property
    def extended(self) -> bool:
        """Whether a prediction's line has batchserve's fields (``access_log_extended``)."""
        return self._extended

    def write(self, client: str, method: str, path: str, protocol: str, status: int,
              latency_s: float, model: str, version: str, queue_wait_s: float,
              batch_size: int, form_s: float = 0.0, batch: Batch | None = None) -> None:
        """Record one prediction (``batch``: the facts of the batch it rode in); called on the
        event loop, costs a tuple and a list append (its phases are worked out when the line
        is written)."""
        if not self._on:
            return
        pending = self._pending
        if not self._extended:
            pending.append((time.time(), client, method, path, protocol, status,
                            latency_s * 1000))
        elif self._with_phases:
            pending.append((time.time(), client, method, path, protocol, status,
                            latency_s * 1000, model, version, queue_wait_s * 1000, batch_size,
                            form_s, batch))
        else:
            pending.append((time.time(), client, method, path, protocol, status,
                            latency_s * 1000, model, version, queue_wait_s * 1000, batch_size))
        if self._flush_handle is None:
            self._schedule()
        elif len(pending) == FLUSH_ENTRIES:
            self._flush_soon()

    def call_ended(self, call: CallFacts) -> None:
        """A prediction ended: its line (a workflow node's call has one only in the extended
        log), and its origin knows it is written. Subscribed only to a server with an access
        log."""
        origin = call.origin
        if origin.node and not self._extended:
            return
        origin.recorded = True
        if not self._on:
            return
        if not self._extended:  # TorchServe's line: what most servers write, kept short
            self._pending.append((time.time(), origin.peer, origin.method, origin.uri,
                                  origin.protocol, call.status, call.latency_s * 1000))
            if self._flush_handle is None:
                self._schedule()
            elif len(self._pending) == FLUSH_ENTRIES:
                self._flush_soon()
            return
        job, key, workflow = call.job, call.key, call.workflow
        name, version = key if key is not None else \
            (workflow, WORKFLOW_VERSION) if workflow is not None else ("-", "-")
        self.write(origin.peer, origin.method, origin.uri, origin.protocol, call.status,
                   call.latency_s, name, version, job.queue_wait_s, job.batch_size,
                   job.form_s, job.batch)

    def request(self, client: str, method: str, path: str, protocol: str, status: int,
                latency_s: float) -> None:
        """Record a request that is not a prediction (TorchServe's fields only)."""
        if not self._on:
            return
        self._pending.append((time.time(), client, method, path, protocol, status,
                              latency_s * 1000))
        self._added()

    @staticmethod
    def _entry_message(entry: tuple[Any, ...], batches: dict[int, str] | None = None) -> str:
        """An entry's message: TorchServe's fields (``entry[1:7]``), then the extended ones
        of a prediction's entry (``entry[7:11]``), then its phases (``entry[11:13]``;
        ``batches``: ``log_fields``'s, for one flush)."""
        extended = len(entry) > 7
        fields = entry[1:11] if extended else entry[1:7]
        if fields[1] == "gRPC":
            fields = (*fields[:4], grpc_status(fields[4]), *fields[5:])
        template = _EXTENDED_ENTRY if extended else _ENTRY
        message = template % fields
        if not message.isprintable():  # rare: a field holds what must be escaped
            message = template % tuple(escape(field) if type(field) is str else field
                                       for field in fields)
        if len(entry) > 11:
            message += " " + log_fields(entry[9] / 1000, entry[11], entry[12],
                                        entry[6] / 1000, batches)
        return message

    def _text(self, entries: list[tuple[Any, ...]]) -> str:
        clock = self._clock
        batches: dict[int, str] = {}
        message = self._entry_message
        lines = [f"{clock(cast(float, entry[0]))} - {message(entry, batches)}"
                 for entry in entries]
        lines.append("")
        return "\n".join(lines)

    def _message(self, entry: tuple[Any, ...]) -> str:
        return self._entry_message(entry)


class ServerLogs:
    """Opens the log files for one server run and closes them at the end. With
    ``named_loggers`` (a log4j2 configuration set them) there is no file of its own: the
    access log and the workers' output go to the loggers ``ACCESS_LOG`` and ``MODEL_LOG``."""

    def __init__(self, log_location: Path, access_log: bool, named_loggers: bool = False,
                 phases: bool = True, extended: bool = False) -> None:
        self.log_location = log_location
        self.named_loggers = named_loggers
        if named_loggers:
            self.access = AccessLog(None, logging.getLogger(TS_ACCESS_LOGGER)
                                    if access_log else None, phases, extended)
            #: This server's worker output (stdout and stderr, line by line: ``log_output``).
            self.model = logging.getLogger(TS_MODEL_LOGGER)
        else:
            self.access = AccessLog(log_location / ACCESS_LOG if access_log else None,
                                    phases=phases, extended=extended)
            # A child per server: two servers in one process keep their model_log.log apart.
            self.model = logging.getLogger(f"{MODEL_LOGGER}.{id(self):x}")
        self._model_file: logging.Handler | None = None

    def __enter__(self) -> ServerLogs:
        if not self.named_loggers:
            self.log_location.mkdir(parents=True, exist_ok=True)
            model_file = pattern_handler(
                logging.FileHandler(self.log_location / MODEL_LOG, encoding="utf-8"))
            self.model.addHandler(model_file)
            self.model.setLevel(logging.INFO)  # worker output is the model log's content
            self._model_file = model_file
        self.access.open()
        return self

    def __exit__(self, *_: object) -> None:
        self.access.close()
        if self._model_file is not None:
            self.model.removeHandler(self._model_file)
            self._model_file.close()
            self._model_file = None


# ---- the server log ---------------------------------------------------------------------

class _EarlyRecords(logging.Handler):
    """Keeps the server log's first records (the last ``limit``) until ``open_server_log``
    knows where its file goes."""

    def __init__(self, limit: int = 10_000) -> None:
        super().__init__()
        self.records: collections.deque[logging.LogRecord] = collections.deque(maxlen=limit)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def console_logging(stream: TextIO, server_log: bool = False) -> None:
    """The default logging (no ``--log-config``), TorchServe's console: the root logger's
    records from INFO up on ``stream`` in ``SERVER_PATTERN``. With ``server_log`` they are
    kept too, until ``open_server_log`` writes them into ts_log.log. (Nothing is changed
    where the root logger has handlers already, as ``logging.basicConfig``.)"""
    handlers: list[logging.Handler] = [pattern_handler(logging.StreamHandler(stream))]
    if server_log:
        handlers.append(_EarlyRecords())
    logging.basicConfig(level=logging.INFO, handlers=handlers)


def open_server_log(location: Path, console: TextIO) -> bool:
    """TorchServe's server log, ``location/ts_log.log``, written from here on as the console
    (``console_logging``), beginning with the records kept so far; an OSError where it cannot
    be made. Not where ``console`` is that file already (a background start sends its
    server's output there): returns whether it is. Nothing where ``console_logging`` kept no
    records (a ``--log-config`` set the logging)."""
    root = logging.getLogger()
    early = next((handler for handler in root.handlers if isinstance(handler, _EarlyRecords)),
                 None)
    if early is None:
        return False
    root.removeHandler(early)
    path = location / SERVER_LOG
    if _is_file(console, path):
        return True
    location.mkdir(parents=True, exist_ok=True)
    log_file = pattern_handler(logging.FileHandler(path, encoding="utf-8"))
    for record in early.records:
        log_file.handle(record)
    root.addHandler(log_file)
    return False


def _is_file(stream: TextIO, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(stream.fileno()), os.stat(path))
    except (OSError, ValueError):  # no such file; a stream without a descriptor
        return False
