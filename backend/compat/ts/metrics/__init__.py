"""``ts.metrics``: TorchServe's metrics API for handlers. The classes live in
``backend.metrics`` (the worker's ``context.metrics`` is one of them); these modules give them
TorchServe's module names."""

from . import dimension, metric, metric_encoder, metrics_store, system_metrics, unit

__all__ = ["dimension", "metric", "metric_encoder", "metrics_store", "system_metrics", "unit"]
