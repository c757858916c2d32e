"""``ts.metrics.unit``: TorchServe's short unit names and the names they are reported under."""

from backend.metrics.types import Units

__all__ = ["Units"]
