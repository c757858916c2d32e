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
cannot start a forged line. Where a logging configuration names them (TorchServe's log4j2
file), they go through the Python loggers ``TS_METRICS`` and ``MODEL_METRICS`` instead.
"""

from __future__ import annotations

import time
from typing import Any, cast

from frontend.observe.logs import BufferedLog, escape

TS_METRICS_LOG = "ts_metrics.log"
MODEL_METRICS_LOG = "model_metrics.log"
#: TorchServe's loggers of the two (log4j2 names).
TS_METRICS_LOGGER = "TS_METRICS"
TS_MODEL_METRICS_LOGGER = "MODEL_METRICS"


class MetricLog(BufferedLog):
    """One metric log: a file, or a logger (``logger``)."""

    def open(self) -> None:
        """Create the file (TorchServe's logging creates it at start, whatever the mode)."""
        if self.logger is None and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        super().open()

    def write(self, message: str) -> None:
        """Log one metric line (its timestamp is now)."""
        if not self._on:
            return
        self._pending.append((time.time(), message))
        if self._flush_handle is None:
            self._schedule()

    def _text(self, entries: list[tuple[Any, ...]]) -> str:
        clock = self._clock
        return "".join(f"{clock(stamp)} - {escape(message)}\n" for stamp, message in entries)

    def _message(self, entry: tuple[Any, ...]) -> str:
        return escape(cast(str, entry[1]))

