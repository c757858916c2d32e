r"""TorchServe's metric log files: ``ts_metrics.log`` (the frontend's metrics) and
``model_metrics.log`` (what handlers report), in ``metrics_mode`` ``log`` (and ``legacy``, for
all but its three Prometheus counters).

Each line is what TorchServe's log4j configuration writes (``%d{ISO8601} - %m``) around a
metric as its ``LogMetric`` formats it::

    2024-05-30T21:41:47,123 - Requests2XX.Count:1.0|#Level:Host|#hostname:h,timestamp:1717105307
    2024-05-30T21:41:47,125 - HandlerTime.ms:17.54|#ModelName:m,Level:Model|#hostname:h,\
        requestID:9f0e,timestamp:1717105307

(the second is one line).

As the access log, the lines are collected on the event loop and written in one go every
0.2 s (a line is written at once where no loop runs). Escaped: a label value a handler chose
cannot start a forged line.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TextIO

from frontend.observe.logs import escape

TS_METRICS_LOG = "ts_metrics.log"
MODEL_METRICS_LOG = "model_metrics.log"
FLUSH_INTERVAL_S = 0.2


class MetricLog:
    """One metric log file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO | None = None
        self._pending: list[tuple[float, str]] = []
        self._flush_handle: asyncio.TimerHandle | None = None

    def open(self) -> None:
        """Create the file (TorchServe's logging creates it at start, whatever the mode)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8", buffering=1 << 16)

    def write(self, message: str) -> None:
        """Log one metric line (its timestamp is now)."""
        if self._file is None:
            return
        self._pending.append((time.time(), message))
        if self._flush_handle is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._flush_handle = loop.call_later(FLUSH_INTERVAL_S, self.flush)

    def flush(self) -> None:
        self._flush_handle = None
        if self._file is None or not self._pending:
            return
        entries, self._pending = self._pending, []
        lines = [f"{_iso8601(stamp)} - {escape(message)}\n" for stamp, message in entries]
        self._file.write("".join(lines))
        self._file.flush()

    def close(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


def _iso8601(seconds: float) -> str:
    """log4j's ``%d{ISO8601}``: ``2024-05-30T21:41:47,123`` (local time)."""
    whole = int(seconds)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(whole))
    return f"{stamp},{int((seconds - whole) * 1000):03d}"
