"""Metric types and unit names, as TorchServe's ``ts.metrics.metric_type_enum`` and
``ts.metrics.unit`` define them."""

from __future__ import annotations

import enum
from typing import Any


class MetricTypes(enum.Enum):
    """How the frontend keeps a metric: a counter adds values up, a gauge keeps the last one,
    a histogram counts them into buckets."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class Units:
    """TorchServe's short unit names and the names metrics are reported under (a unit not
    in the table is reported as given)."""

    def __init__(self) -> None:
        self.units: dict[str | None, str] = {
            "ms": "Milliseconds",
            "s": "Seconds",
            "percent": "Percent",
            "count": "Count",
            "MB": "Megabytes",
            "GB": "Gigabytes",
            "kB": "Kilobytes",
            "B": "Bytes",
            "": "unit",
            None: "unit",
        }


def metric_type(value: Any) -> MetricTypes | None:
    """``value`` as a MetricTypes member: ours, another copy's member (a real TorchServe's
    enum, say) by its value, or the type's name; None when it names no type."""
    if isinstance(value, MetricTypes):
        return value
    text = getattr(value, "value", value)
    if isinstance(text, str):
        try:
            return MetricTypes(text.lower())
        except ValueError:
            return None
    return None
