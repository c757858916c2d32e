"""``ts.metrics.metric_cache_yaml_impl``: the metrics cache read from a ``metrics.yaml`` (the
worker's ``context.metrics`` is one)."""

from backend.metrics import errors as merrors
from backend.metrics.cache import MetricCacheAbstract, MetricsCacheYamlImpl, logger
from backend.metrics.caching import CachingMetric
from backend.metrics.types import MetricTypes

__all__ = ["CachingMetric", "MetricCacheAbstract", "MetricTypes", "MetricsCacheYamlImpl",
           "logger", "merrors"]
