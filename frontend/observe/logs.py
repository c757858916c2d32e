r"""Log files: the access log (one line per request, written in bulk off the hot path), the
model log; and the escaping that keeps client bytes from forging log lines.

Both are files in ``log_location``, unless a logging configuration names them (TorchServe's
log4j2 file, ``log4j.py``): then they are written through the Python loggers of TorchServe's
names, ``ACCESS_LOG`` and ``MODEL_LOG``, whose handlers that configuration chose.

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
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TextIO, cast

from frontend.observe.timing import Timing, log_fields

ACCESS_LOG = "access_log.log"
MODEL_LOG = "model_log.log"
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
#: An access log entry, after its time.
_ENTRY = '%s "%s %s %s" %d %.1fms model=%s version=%s queue_ms=%.2f batch=%d'
_LINE = f"%s {_ENTRY}"
#: Where a record's relativeCreated counts from (logging's own start time).
_START_TIME: float = getattr(logging, "_startTime", time.time())


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
    """One line per request: TorchServe's first fields (client, request line, status,
    latency), then ours (model, version, queue wait, batch size), then where its time went
    (``timing.log_fields``: the batch's forming, the worker, the handler's steps, the
    frontend, and why its batch left the queue) unless ``phases`` is off
    (``request_phases=false``)."""

    def __init__(self, path: Path | None, logger: logging.Logger | None = None,
                 phases: bool = True) -> None:
        super().__init__(path, logger)
        self._stamp_second = -1
        self._stamp = ""
        self._with_phases = phases

    def write(self, client: str, method: str, path: str, protocol: str, status: int,
              latency_s: float, model: str, version: str, queue_wait_s: float,
              batch_size: int, form_s: float = 0.0, timing: Timing | None = None) -> None:
        """Record one request; called on the event loop, costs a tuple and a list append
        (its phases are worked out when the line is written)."""
        if not self._on:
            return
        pending = self._pending
        if self._with_phases:
            pending.append((time.time(), client, method, path, protocol, status,
                            latency_s * 1000, model, version, queue_wait_s * 1000, batch_size,
                            form_s, timing))
        else:
            pending.append((time.time(), client, method, path, protocol, status,
                            latency_s * 1000, model, version, queue_wait_s * 1000, batch_size))
        if self._flush_handle is None:
            self._schedule()
        elif len(pending) == FLUSH_ENTRIES:
            self._flush_soon()

    @staticmethod
    def _phases(entry: tuple[Any, ...], batches: dict[int, str] | None = None) -> str:
        """The entry's phase fields after a space (``_ENTRY``'s fields are ``entry[1:11]``;
        ``batches``: ``log_fields``'s, for one flush); none for an entry written with phases
        off."""
        if len(entry) < 13:
            return ""
        return " " + log_fields(entry[9] / 1000, entry[11], entry[12], entry[6] / 1000,
                                batches)

    def _timestamp(self, seconds: float) -> str:
        whole = int(seconds)
        if whole != self._stamp_second:
            self._stamp_second = whole
            self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(whole))
        return f"{self._stamp},{int((seconds - whole) * 1000):03d}"

    def _text(self, entries: list[tuple[Any, ...]]) -> str:
        lines = []
        batches: dict[int, str] = {}
        for entry in entries:
            stamp = self._timestamp(cast(float, entry[0]))
            fields = entry[1:11]
            line = _LINE % (stamp, *fields)
            if not line.isprintable():  # rare: a field holds what must be escaped
                line = _LINE % (stamp, *(escape(field) if type(field) is str else field
                                         for field in fields))
            lines.append(f"{line}{self._phases(entry, batches)}")
        lines.append("")
        return "\n".join(lines)

    def _message(self, entry: tuple[Any, ...]) -> str:
        fields = entry[1:11]
        message = _ENTRY % fields
        if not message.isprintable():
            message = _ENTRY % tuple(escape(field) if type(field) is str else field
                                     for field in fields)
        return f"{message}{self._phases(entry)}"


class ServerLogs:
    """Opens the log files for one server run and closes them at the end. With
    ``named_loggers`` (a log4j2 configuration set them) there is no file of its own: the
    access log and the workers' output go to the loggers ``ACCESS_LOG`` and ``MODEL_LOG``."""

    def __init__(self, log_location: Path, access_log: bool, named_loggers: bool = False,
                 phases: bool = True) -> None:
        self.log_location = log_location
        self.named_loggers = named_loggers
        if named_loggers:
            self.access = AccessLog(None, logging.getLogger(TS_ACCESS_LOGGER)
                                    if access_log else None, phases)
            #: This server's worker output (stdout and stderr, line by line).
            self.model = logging.getLogger(TS_MODEL_LOGGER)
        else:
            self.access = AccessLog(log_location / ACCESS_LOG if access_log else None,
                                    phases=phases)
            # A child per server: two servers in one process keep their model_log.log apart.
            self.model = logging.getLogger(f"{MODEL_LOGGER}.{id(self):x}")
        self._model_file: logging.Handler | None = None

    def __enter__(self) -> ServerLogs:
        if not self.named_loggers:
            self.log_location.mkdir(parents=True, exist_ok=True)
            model_file = logging.FileHandler(self.log_location / MODEL_LOG, encoding="utf-8")
            model_file.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
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
