"""``ts.metrics.metric``: the older metric object (a counter with fixed dimensions)."""

from collections import OrderedDict

from backend.metrics.caching import CachingMetric
from backend.metrics.legacy import Metric, MetricUnit
from backend.metrics.types import MetricTypes, Units

__all__ = ["CachingMetric", "Metric", "MetricTypes", "MetricUnit", "OrderedDict", "Units"]
