"""``ts.metrics.metric_abstract``: the interface of a metric object."""

from backend.metrics.caching import MetricAbstract, MetricUnit
from backend.metrics.types import MetricTypes, Units

__all__ = ["MetricAbstract", "MetricTypes", "MetricUnit", "Units"]
