"""``ts.metrics.metric_type_enum``: the metric types ``context.metrics`` accepts."""

from __future__ import annotations

import enum


class MetricTypes(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"
