"""A metric object a handler updates (TorchServe's ``MetricAbstract`` and ``CachingMetric``):
its name, unit, dimension names and type are fixed; each ``add_or_update`` reports one value
with one value per dimension."""

from __future__ import annotations

import abc
import logging
import math
import numbers
from typing import Any

from backend.metrics.dimension import Dimension
from backend.metrics.sink import DEFAULT_SINK, MetricSink
from backend.metrics.types import MetricTypes, Units, metric_type

logger = logging.getLogger(__name__)

MetricUnit = Units()


class MetricAbstract(metaclass=abc.ABCMeta):
    """A metric's declaration; subclasses report its values."""

    def __init__(
        self,
        metric_name: str,
        unit: str,
        dimension_names: list[str] | None = None,
        metric_type: MetricTypes = MetricTypes.COUNTER,
    ) -> None:
        self.metric_name = metric_name
        # TorchServe's short unit names are reported under their long names ("ms" as
        # "Milliseconds"); any other unit as given.
        self.unit = MetricUnit.units.get(unit, unit) if isinstance(unit, str) else unit
        self.dimension_names: list[str] = list(dimension_names or [])
        self.metric_type = metric_type

    @abc.abstractmethod
    def add_or_update(
        self,
        value: float,
        dimension_values: list[Any],
        request_id: str = "",
    ) -> None:
        """Report ``value`` for the dimension values given (one per dimension name)."""


class CachingMetric(MetricAbstract):
    """A metric whose values go to the frontend (TorchServe: a ``[METRICS]`` log line; here:
    its cache's sink, sent with the batch's result)."""

    #: Where its values go; a metrics cache sets its own on the metrics it makes.
    sink: MetricSink = DEFAULT_SINK

    def _validate_and_get_dimensions(self, dimension_values: list[Any] | None) -> list[Dimension]:
        """One Dimension per dimension name, or ValueError when the counts differ."""
        if dimension_values is None or len(dimension_values) != len(self.dimension_names):
            raise ValueError(
                f"Dimension values: {dimension_values} should "
                f"correspond to Dimension names: {self.dimension_names}"
            )
        return [Dimension(name, value)
                for name, value in zip(self.dimension_names, dimension_values, strict=True)]

    def _validate_metric_value(self, value: Any) -> None:
        """A counter only grows; and a value must be a finite number (TorchServe's frontend
        cannot parse anything else from its log line, and drops it)."""
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or not math.isfinite(float(value)):
            raise ValueError(f"the value must be a finite number, got {value!r}")
        if metric_type(self.metric_type) is MetricTypes.COUNTER and value < 0:
            raise ValueError("Counter metric update value cannot be negative")

    def emit_metrics(self, request_id: str, value: float, dimension_string: str) -> None:
        """Report one value; ``dimension_string`` is ``"name:value,name:value"`` (how
        TorchServe writes dimensions)."""
        dimensions = []
        for pair in filter(None, dimension_string.split(",")):
            name, _, dim_value = pair.partition(":")
            dimensions.append(Dimension(name, dim_value))
        self._emit(request_id, value, dimensions)

    def _emit(self, request_id: Any, value: float, dimensions: list[Dimension]) -> None:
        kind = metric_type(self.metric_type)
        if kind is None:
            logger.error("[METRICS]%s has no metric type (%r): not reported", self.metric_name,
                         self.metric_type)
            return
        self.sink.emit(self.metric_name, str(self.unit), kind.value, float(value),
                       [str(d.name) for d in dimensions], [str(d.value) for d in dimensions],
                       "" if request_id is None else str(request_id))

    def add_or_update(
        self,
        value: float,
        dimension_values: list[Any] | None = [],  # noqa: B006 (TorchServe's; read only)
        request_id: str = "",
    ) -> None:
        """Report ``value`` with one value per dimension name, in their order; a bad value or
        a wrong number of dimension values is logged and not reported (as TorchServe)."""
        if dimension_values is None:
            dimension_values = []
        dimension_str = ""
        try:
            dimensions = self._validate_and_get_dimensions(dimension_values)
            dimension_str = ",".join(str(d) for d in dimensions)
            self._validate_metric_value(value)
        except ValueError as ex:
            logger.error(
                "[METRICS]Failed to update metric with name:%s and dimensions: %s with value: "
                "%s: %s", self.metric_name, dimension_str, value, ex)
        else:
            self._emit(request_id, value, dimensions)

    def update(
        self,
        value: float,
        request_id: str = "",
        dimensions: list[Any] | None = [],  # noqa: B006 (TorchServe's; read only)
    ) -> None:
        """Older API: report ``value`` with these Dimension objects, which replace the
        metric's dimension names."""
        logger.warning("Overriding existing dimensions")
        dims = list(dimensions or [])
        self.dimension_names = [dim.name for dim in dims]
        self.add_or_update(value, [dim.value for dim in dims], request_id)
