"""``ts.metrics.dimension``: a metric dimension, a name and a value."""

from backend.metrics.dimension import Dimension

__all__ = ["Dimension"]
