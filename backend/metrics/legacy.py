"""TorchServe's older metric objects, kept for handlers written against them: ``Metric`` (a
counter with fixed dimensions), ``MetricsStore`` (the pre-0.8 ``context.metrics``) and
``MetricEncoder`` (JSON for both). Their values report like any other metric's."""

from __future__ import annotations

import json
import socket
import time
from collections import OrderedDict
from typing import Any

from backend.metrics.caching import CachingMetric
from backend.metrics.dimension import Dimension, as_dimension
from backend.metrics.types import MetricTypes, Units

MetricUnit = Units()


class Metric:
    """A counter with its dimensions and request id fixed; ``update`` reports a value."""

    def __init__(
        self,
        name: str,
        value: float,
        unit: str,
        dimensions: list[Any],
        request_id: str | None = None,
        metric_method: str | None = None,
    ) -> None:
        self.metric_type = MetricTypes.COUNTER
        self.dimensions = [as_dimension(dim) for dim in dimensions]
        self.dimension_names = [dim.name for dim in self.dimensions]
        self.dimension_values = [dim.value for dim in self.dimensions]
        self._caching_metric = CachingMetric(metric_name=name, unit=unit,
                                             dimension_names=self.dimension_names,
                                             metric_type=self.metric_type)
        self.name = self._caching_metric.metric_name
        self.unit = self._caching_metric.unit
        self.metric_method = metric_method
        self.value = value
        self.request_id = request_id

    def update(self, value: float) -> None:
        """Report ``value``."""
        self._caching_metric.add_or_update(value, self.dimension_values,
                                           request_id=self.request_id or "")

    def reset(self) -> None:
        """Report 0."""
        self._caching_metric.add_or_update(0, self.dimension_values,
                                           request_id=self.request_id or "")

    def __str__(self) -> str:
        dims = ",".join(str(d) for d in self.dimensions)
        text = (f"{self.name}.{self.unit}:{self.value}|#{dims}|#hostname:{socket.gethostname()},"
                f"{int(time.time())}")
        return f"{text},{self.request_id}" if self.request_id else text

    def to_dict(self) -> OrderedDict[str, Any]:
        return OrderedDict({
            "MetricName": self.name,
            "Value": self.value,
            "Unit": self.unit,
            "Dimensions": self.dimensions,
            "Timestamp": int(time.time()),
            "HostName": socket.gethostname(),
            "RequestId": self.request_id,
        })


class MetricEncoder(json.JSONEncoder):
    """JSON for Metric and Dimension objects (their ``to_dict``)."""

    def default(self, obj: Any) -> Any:
        if isinstance(obj, (Metric, Dimension)):
            return obj.to_dict()
        return json.JSONEncoder.default(self, obj)


class MetricsStore:
    """DEPRECATED in TorchServe: metrics by name, unit, request and dimensions. Each value
    added is reported (TorchServe 0.12 reports only the second and later ones of a metric)."""

    def __init__(self, request_ids: Any, model_name: str) -> None:
        self.store: list[Metric] = []
        self.request_ids = request_ids
        self.model_name = model_name
        self.cache: dict[str, Metric] = {}

    def _add_or_update(self, name: str, value: float, req_id: Any, unit: str,
                       metrics_method: str | None = None,
                       dimensions: list[Any] | None = None) -> None:
        if dimensions is None:
            dimensions = []
        elif not isinstance(dimensions, list):
            raise ValueError("Please provide a list of dimensions")
        dims = [as_dimension(dim) for dim in dimensions]
        if req_id is None:
            dims.append(Dimension("Level", "Error"))
        else:
            dims.append(Dimension("ModelName", self.model_name))
            dims.append(Dimension("Level", "Model"))
        key = "-".join([name, unit, str(req_id), *(str(d) for d in dims)])
        metric = self.cache.get(key)
        if metric is None:
            metric = self.cache[key] = Metric(name, value, unit, dims, req_id, metrics_method)
            self.store.append(metric)
        metric.value = value
        metric.update(value)

    def _get_req(self, idx: Any) -> Any:
        req_id = self.request_ids
        if isinstance(req_id, dict):
            req_id = ",".join(str(value) for value in self.request_ids.values())
        if idx is not None and self.request_ids is not None and idx in self.request_ids:
            req_id = self.request_ids[idx]
        return req_id

    def add_counter(self, name: str, value: float, idx: Any = None,
                    dimensions: list[Any] | None = None) -> None:
        self._add_or_update(name, value, self._get_req(idx), "count", "counter", dimensions)

    def add_time(self, name: str, value: float, idx: Any = None, unit: str = "ms",
                 dimensions: list[Any] | None = None) -> None:
        if unit not in ("ms", "s"):
            raise ValueError("the unit for a timed metric should be one of ['ms', 's']")
        self._add_or_update(name, value, self._get_req(idx), unit, None, dimensions)

    def add_size(self, name: str, value: float, idx: Any = None, unit: str = "MB",
                 dimensions: list[Any] | None = None) -> None:
        if unit not in ("MB", "kB", "GB", "B"):
            raise ValueError("The unit for size based metric is one of ['MB','kB', 'GB', 'B']")
        self._add_or_update(name, value, self._get_req(idx), unit, None, dimensions)

    def add_percent(self, name: str, value: float, idx: Any = None,
                    dimensions: list[Any] | None = None) -> None:
        self._add_or_update(name, value, self._get_req(idx), "percent", None, dimensions)

    def add_error(self, name: str, value: float, dimensions: list[Any] | None = None) -> None:
        self._add_or_update(name, value, None, "", None, dimensions)

    def add_metric(self, name: str, value: float, unit: str, idx: Any = None,
                   dimensions: list[Any] | None = None) -> None:
        self._add_or_update(name, value, self._get_req(idx), unit, None, dimensions)
