"""``ts.metrics.metric_cache_errors``: what the metrics cache raises."""

from backend.metrics.errors import (
    GeneralMetricsCacheError,
    MetricsCacheIOError,
    MetricsCacheKeyError,
    MetricsCachePyYamlError,
    MetricsCacheTypeError,
    MetricsCacheValueError,
)

__all__ = ["GeneralMetricsCacheError", "MetricsCacheIOError", "MetricsCacheKeyError",
           "MetricsCachePyYamlError", "MetricsCacheTypeError", "MetricsCacheValueError"]
