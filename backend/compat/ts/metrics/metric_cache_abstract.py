"""``ts.metrics.metric_cache_abstract``: the metrics cache's interface and ``add_*`` methods."""

from backend.metrics import errors as merrors
from backend.metrics.cache import MetricCacheAbstract
from backend.metrics.caching import MetricAbstract
from backend.metrics.dimension import Dimension
from backend.metrics.types import MetricTypes

__all__ = ["Dimension", "MetricAbstract", "MetricCacheAbstract", "MetricTypes", "merrors"]
