"""``ts.metrics.metric_encoder``: JSON for Metric and Dimension objects."""

from json import JSONEncoder

from backend.metrics.dimension import Dimension
from backend.metrics.legacy import Metric, MetricEncoder

__all__ = ["Dimension", "JSONEncoder", "Metric", "MetricEncoder"]
