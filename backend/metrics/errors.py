"""The errors of the metrics cache (TorchServe's ``ts.metrics.metric_cache_errors``): what a
handler catches when it asks for a metric that does not exist, or passes a bad argument."""

from __future__ import annotations

import yaml


class GeneralMetricsCacheError(Exception):
    """Anything else that went wrong reading a metrics configuration."""

    def __init__(self, message: str) -> None:
        super().__init__(f"Generic error: {message}")


class MetricsCacheIOError(IOError):
    """The metrics configuration could not be read."""

    def __init__(self, message: str) -> None:
        super().__init__(f"Error reading file: {message}")


class MetricsCachePyYamlError(yaml.YAMLError):
    """The metrics configuration is not YAML."""

    def __init__(self, message: str) -> None:
        super().__init__(f"Error parsing file: {message}")


class MetricsCacheTypeError(TypeError):
    """An argument of the wrong type (a metric name that is not a str, ...)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{message}")


class MetricsCacheValueError(ValueError):
    """A bad value (a time metric's unit that is neither ms nor s, ...)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{message}")


class MetricsCacheKeyError(KeyError):
    """No such metric (``get_metric``), or a configuration that lacks a key."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{message}")
