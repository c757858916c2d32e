"""Log files: the access log (one line per request, written off the hot path), the model log.

The access log goes through a queue: the request path only enqueues an unformatted record, a
listener thread formats and writes it (TorchServe's default logging costs it half its echo
throughput; see benchmarks/RESULTS.md for ours with the access log on and off).
"""

from __future__ import annotations

import logging
import logging.handlers
import queue
from pathlib import Path

ACCESS_LOG = "access_log.log"
MODEL_LOG = "model_log.log"
access_logger = logging.getLogger("batchserve.access")
model_logger = logging.getLogger("batchserve.model")


class _UnformattedQueueHandler(logging.handlers.QueueHandler):
    """Queue the record as it is: formatting happens in the listener thread."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


class ServerLogs:
    """Opens the log files for one server run and closes them at the end."""

    def __init__(self, log_location: Path, access_log: bool) -> None:
        self.log_location = log_location
        self.access_log = access_log
        self._listener: logging.handlers.QueueListener | None = None
        self._handlers: list[tuple[logging.Logger, logging.Handler]] = []

    def __enter__(self) -> ServerLogs:
        self.log_location.mkdir(parents=True, exist_ok=True)
        model_file = logging.FileHandler(self.log_location / MODEL_LOG, encoding="utf-8")
        model_file.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        model_logger.addHandler(model_file)
        model_logger.setLevel(logging.INFO)  # worker output is the model log's content
        self._handlers.append((model_logger, model_file))
        access_logger.propagate = False  # never to the terminal: it is per request
        if self.access_log:
            access_file = logging.FileHandler(self.log_location / ACCESS_LOG, encoding="utf-8")
            access_file.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
            records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
            handler = _UnformattedQueueHandler(records)
            access_logger.addHandler(handler)
            access_logger.setLevel(logging.INFO)
            self._handlers.append((access_logger, handler))
            self._listener = logging.handlers.QueueListener(records, access_file)
            self._listener.start()
        else:
            access_logger.setLevel(logging.WARNING)
        return self

    def __exit__(self, *_: object) -> None:
        if self._listener is not None:
            self._listener.stop()  # writes what is queued, then closes
            for handler in self._listener.handlers:
                handler.close()
            self._listener = None
        for logger, handler in self._handlers:
            logger.removeHandler(handler)
            handler.close()
        self._handlers.clear()


def log_access(client: str, method: str, path: str, protocol: str, status: int,
               latency_s: float, model: str, version: str, queue_wait_s: float,
               batch_size: int) -> None:
    """One access-log line (TorchServe's first fields, then ours)."""
    if access_logger.isEnabledFor(logging.INFO):
        access_logger.info('%s "%s %s %s" %d %.1fms model=%s version=%s queue_ms=%.2f batch=%d',
                           client, method, path, protocol, status, latency_s * 1000, model,
                           version, queue_wait_s * 1000, batch_size)
