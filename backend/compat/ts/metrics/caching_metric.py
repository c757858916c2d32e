"""``ts.metrics.caching_metric``: a metric object whose values go to the frontend (TorchServe
logs them as ``[METRICS]`` lines; batchserve's worker sends them with the batch's result)."""

from backend.metrics.caching import CachingMetric, MetricAbstract, logger
from backend.metrics.dimension import Dimension
from backend.metrics.types import MetricTypes

__all__ = ["CachingMetric", "Dimension", "MetricAbstract", "MetricTypes", "logger"]
