r"""Log files: the access log (one line per request, written in bulk off the hot path), the
model log; and the escaping that keeps client bytes from forging log lines.

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

ACCESS_LOG = "access_log.log"
MODEL_LOG = "model_log.log"
#: The parent of every server's model logger (a child per server, so that two servers in
#: one process write their workers' output to their own model_log.log).
MODEL_LOGGER = "batchserve.model"
FLUSH_INTERVAL_S = 0.2
_LINE = '%s %s "%s %s %s" %d %.1fms model=%s version=%s queue_ms=%.2f batch=%d'


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
    """A log file written in one go every ``FLUSH_INTERVAL_S``: lines are collected on the
    event loop (a tuple and a list append each) and formatted by ``_text`` when flushed; a
    line is written at once where no loop runs."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file: TextIO | None = None
        #: (unix time, then the entry's fields)
        self._pending: list[tuple[Any, ...]] = []
        self._flush_handle: asyncio.TimerHandle | None = None

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def open(self) -> None:
        if self.path is not None:
            self._file = self.path.open("a", encoding="utf-8", buffering=1 << 16)

    def _schedule(self) -> None:
        """An entry was added: flush within FLUSH_INTERVAL_S (at once without a loop)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._flush_handle = loop.call_later(FLUSH_INTERVAL_S, self.flush)

    def _text(self, entries: list[tuple[Any, ...]]) -> str:
        raise NotImplementedError

    def flush(self) -> None:
        self._flush_handle = None
        if self._file is None or not self._pending:
            return
        entries, self._pending = self._pending, []
        self._file.write(self._text(entries))
        self._file.flush()

    def close(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


class AccessLog(BufferedLog):
    """One line per request: TorchServe's first fields (client, request line, status,
    latency), then ours (model, version, queue wait, batch size)."""

    def __init__(self, path: Path | None) -> None:
        super().__init__(path)
        self._stamp_second = -1
        self._stamp = ""

    def write(self, client: str, method: str, path: str, protocol: str, status: int,
              latency_s: float, model: str, version: str, queue_wait_s: float,
              batch_size: int) -> None:
        """Record one request; called on the event loop, costs a tuple and a list append."""
        if self._file is None:
            return
        self._pending.append((time.time(), client, method, path, protocol, status,
                              latency_s * 1000, model, version, queue_wait_s * 1000, batch_size))
        if self._flush_handle is None:
            self._schedule()

    def _timestamp(self, seconds: float) -> str:
        whole = int(seconds)
        if whole != self._stamp_second:
            self._stamp_second = whole
            self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(whole))
        return f"{self._stamp},{int((seconds - whole) * 1000):03d}"

    def _text(self, entries: list[tuple[Any, ...]]) -> str:
        lines = []
        for entry in entries:
            stamp = self._timestamp(cast(float, entry[0]))
            line = _LINE % (stamp, *entry[1:])
            if not line.isprintable():  # rare: a field holds what must be escaped
                line = _LINE % (stamp, *(escape(field) if type(field) is str else field
                                         for field in entry[1:]))
            lines.append(line)
        lines.append("")
        return "\n".join(lines)


class ServerLogs:
    """Opens the log files for one server run and closes them at the end."""

    def __init__(self, log_location: Path, access_log: bool) -> None:
        self.log_location = log_location
        self.access = AccessLog(log_location / ACCESS_LOG if access_log else None)
        #: This server's worker output (stdout and stderr, line by line).
        self.model = logging.getLogger(f"{MODEL_LOGGER}.{id(self):x}")
        self._model_file: logging.Handler | None = None

    def __enter__(self) -> ServerLogs:
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
