"""``ts.metrics.metrics_store``: TorchServe's deprecated metrics store."""

from backend.metrics.dimension import Dimension
from backend.metrics.legacy import Metric, MetricsStore

__all__ = ["Dimension", "Metric", "MetricsStore"]
