"""``ts.metrics.metric_type_enum``: the metric types (counter, gauge, histogram)."""

from backend.metrics.types import MetricTypes

__all__ = ["MetricTypes"]
