"""``context.metrics``: the metrics a model's handler reports, by name and type
(TorchServe's ``MetricCacheAbstract`` and ``MetricsCacheYamlImpl``).

The cache starts with the ``model_metrics`` of the server's metrics configuration (a
TorchServe ``metrics.yaml``); ``add_metric_to_cache`` declares more; ``get_metric`` finds one;
``add_metric``/``add_counter``/``add_time``/``add_size``/``add_percent``/``add_error`` declare a
metric on first use and report a value at once, with the dimensions TorchServe adds:
``ModelName`` and ``Level:Model`` (``Level:Error`` outside any request). Whether the frontend
keeps a metric that its configuration does not declare is its ``model_metrics_auto_detect``.
"""

from __future__ import annotations

import abc
import logging
import os
from typing import Any

from backend.metrics import errors as merrors
from backend.metrics.caching import CachingMetric, MetricAbstract
from backend.metrics.dimension import Dimension, as_dimension
from backend.metrics.sink import MetricSink
from backend.metrics.types import MetricTypes, metric_type

logger = logging.getLogger(__name__)

_TIME_UNITS = ("ms", "s")
_SIZE_UNITS = ("MB", "kB", "GB", "B")


class MetricCacheAbstract(metaclass=abc.ABCMeta):
    """Metric objects by type and name, and the ``add_*`` shortcuts that report through
    them."""

    def __init__(self, config_file_path: str | None) -> None:
        self.cache: dict[MetricTypes, dict[str, MetricAbstract]] = {}
        self.store: list[Any] = []
        self.request_ids: Any = None
        self.model_name: str | None = None
        self.config_file_path = config_file_path
        #: batchserve: where this cache's metrics report (the worker sends what is in it).
        self.sink = MetricSink()
        try:
            os.path.exists(self.config_file_path)  # type: ignore[arg-type]
        except Exception as exc:
            raise merrors.MetricsCacheTypeError(
                f"Error loading {config_file_path} file: {exc}") from exc

    def _add_default_dims(self, idx: Any, dimensions: list[Any] | None) -> list[Dimension]:
        """The dimensions with TorchServe's defaults added: ``Level:Error`` without a request
        (``idx`` None), else ``ModelName`` and ``Level:Model`` (each unless given)."""
        dims = [as_dimension(item) for item in dimensions or []]
        names = [dim.name for dim in dims]
        if idx is None:
            if "Level" not in names:
                dims.append(Dimension("Level", "Error"))
        else:
            if "ModelName" not in names:
                dims.append(Dimension("ModelName", self.model_name))
            if "Level" not in names:
                dims.append(Dimension("Level", "Model"))
        return dims

    def set_request_ids(self, request_ids: Any) -> None:
        self.request_ids = request_ids

    def _get_req(self, idx: Any) -> Any:
        """The request id for request ``idx`` of the batch; without one, all the batch's ids
        joined by commas."""
        req_id = self.request_ids
        if isinstance(req_id, dict):
            req_id = ",".join(str(value) for value in req_id.values())
        if idx is not None and self.request_ids is not None and idx in self.request_ids:
            req_id = self.request_ids[idx]
        return req_id

    def _report(self, name: str, value: float, unit: str, idx: Any, dimensions: list[Any] | None,
                kind: Any) -> None:
        req_id = self._get_req(idx)
        dims = self._add_default_dims(req_id, dimensions)
        metric = self._get_or_add_metric(name, unit, dims, kind)
        metric.add_or_update(value, [dim.value for dim in dims], req_id)

    def add_metric(
        self,
        name: str,
        value: float,
        unit: str,
        idx: Any = None,
        dimensions: list[Any] | None = [],  # noqa: B006 (TorchServe's; read only)
        metric_type: MetricTypes = MetricTypes.COUNTER,
    ) -> None:
        """Report a value of a metric of any type (declared on first use)."""
        self._report(name, value, unit, idx, dimensions, metric_type)

    def add_counter(
        self,
        name: str,
        value: float,
        idx: Any = None,
        dimensions: list[Any] | None = [],  # noqa: B006 (TorchServe's; read only)
    ) -> None:
        """Add ``value`` to a counter (unit ``count``)."""
        self._report(name, value, "count", idx, dimensions, MetricTypes.COUNTER)

    def add_time(
        self,
        name: str,
        value: float,
        idx: Any = None,
        unit: str = "ms",
        dimensions: list[Any] | None = [],  # noqa: B006 (TorchServe's; read only)
        metric_type: MetricTypes = MetricTypes.GAUGE,
    ) -> None:
        """Report a duration, in ``ms`` or ``s`` (a gauge unless told otherwise)."""
        if unit not in _TIME_UNITS:
            raise merrors.MetricsCacheValueError(
                "the unit for a timed metric should be one of ['ms', 's']")
        self._report(name, value, unit, idx, dimensions, metric_type)

    def add_size(
        self,
        name: str,
        value: float,
        idx: Any = None,
        unit: str = "MB",
        dimensions: list[Any] | None = [],  # noqa: B006 (TorchServe's; read only)
        metric_type: MetricTypes = MetricTypes.GAUGE,
    ) -> None:
        """Report a size, in ``MB``, ``kB``, ``GB`` or ``B`` (a gauge unless told otherwise)."""
        if unit not in _SIZE_UNITS:
            raise ValueError("The unit for size based metric is one of ['MB','kB', 'GB', 'B']")
        self._report(name, value, unit, idx, dimensions, metric_type)

    def add_percent(
        self,
        name: str,
        value: float,
        idx: Any = None,
        dimensions: list[Any] | None = [],  # noqa: B006 (TorchServe's; read only)
        metric_type: MetricTypes = MetricTypes.GAUGE,
    ) -> None:
        """Report a percentage (a gauge unless told otherwise)."""
        self._report(name, value, "percent", idx, dimensions, metric_type)

    def add_error(
        self,
        name: str,
        value: float,
        dimensions: list[Any] | None = [],  # noqa: B006 (TorchServe's; read only)
    ) -> None:
        """Count an error (a counter with ``Level:Error`` and no request)."""
        dims = self._add_default_dims(None, dimensions)
        metric = self._get_or_add_metric(name, "", dims, MetricTypes.COUNTER)
        metric.add_or_update(value, [dim.value for dim in dims])

    def _get_or_add_metric(self, metric_name: str, unit: str, dimensions: list[Dimension],
                           metric_type: Any) -> MetricAbstract:
        try:
            return self.get_metric(metric_name, metric_type)
        except merrors.MetricsCacheKeyError:
            return self.add_metric_to_cache(
                metric_name=metric_name, unit=unit, metric_type=metric_type,
                dimension_names=[dim.name for dim in dimensions])

    @staticmethod
    def _check_type(variable: Any, expected_type: type | tuple[type, ...],
                    helper_text: str) -> None:
        if not isinstance(variable, expected_type):
            raise merrors.MetricsCacheTypeError(helper_text)

    @staticmethod
    def _metric_type(value: Any) -> MetricTypes:
        """``value`` as a MetricTypes member (another copy's members are taken by value)."""
        kind = metric_type(value)
        if kind is None:
            raise merrors.MetricsCacheTypeError("`metric_type` must be a MetricTypes enum")
        return kind

    @abc.abstractmethod
    def initialize_cache(self) -> None:
        """Declare the metrics of the configuration."""

    @abc.abstractmethod
    def get_metric(self, metric_name: str,
                   metric_type: MetricTypes = MetricTypes.COUNTER) -> MetricAbstract:
        """The metric of that name and type, or MetricsCacheKeyError."""

    @abc.abstractmethod
    def add_metric_to_cache(self, metric_name: str, unit: str,
                            dimension_names: list[str] | None = [],  # noqa: B006 (TorchServe's; read only)
                            metric_type: MetricTypes = MetricTypes.COUNTER) -> MetricAbstract:
        """Declare a metric (replacing one of the same name and type); it reports nothing
        until it is updated."""


class MetricsCacheYamlImpl(MetricCacheAbstract):
    """A metrics cache whose metrics are first those of a TorchServe ``metrics.yaml``."""

    def __init__(self, config_file_path: str | None) -> None:
        super().__init__(config_file_path=config_file_path)
        self._parsed_file: Any = None
        self._parse_yaml_file(self.config_file_path)

    @classmethod
    def without_config(cls) -> MetricsCacheYamlImpl:
        """batchserve: a cache that declares nothing yet (a Context made without one)."""
        cache = cls.__new__(cls)
        MetricCacheAbstract.__init__(cache, "")
        cache._parsed_file = {}
        return cache

    def _parse_yaml_file(self, config_file_path: str | None) -> None:
        if not config_file_path:
            raise merrors.MetricsCacheTypeError("Config file not initialized")
        import yaml  # the errors module has it loaded already

        try:
            with open(config_file_path, encoding="utf-8") as file:
                self._parsed_file = yaml.safe_load(file)
            logger.info("Successfully loaded %s.", config_file_path)
        except yaml.YAMLError as exc:
            raise merrors.MetricsCachePyYamlError(
                f"Error parsing file {config_file_path}: {exc}") from exc
        except OSError as io_err:
            raise merrors.MetricsCacheIOError(
                f"Error reading file {config_file_path}: {io_err}") from io_err
        except Exception as err:
            raise merrors.GeneralMetricsCacheError(
                f"General error found in file {config_file_path}: {err}") from err

    def _parse_metrics_section(self, key: str = "model_metrics") -> Any:
        try:
            return self._parsed_file[key]
        except (KeyError, TypeError) as err:
            raise merrors.MetricsCacheKeyError(
                f"'{key}' key not found in yaml file: {err}") from err

    def initialize_cache(self) -> None:
        """Declare the ``model_metrics`` of the configuration (raises when it has none)."""
        metrics_section = self._parse_metrics_section("model_metrics")
        if not metrics_section:
            raise merrors.MetricsCacheValueError("Missing `model_metrics` specification")
        for type_name, metrics_list in metrics_section.items():
            try:
                kind = MetricTypes(type_name)
            except Exception as exc:
                raise merrors.MetricsCacheKeyError(f"Invalid metric type: {exc}") from exc
            for metric in metrics_list or []:
                try:
                    self.add_metric_to_cache(
                        metric_name=metric["name"], unit=metric["unit"],
                        dimension_names=metric["dimensions"], metric_type=kind)
                except KeyError as k_err:
                    raise merrors.MetricsCacheKeyError(
                        f"Key not found in cache spec: {k_err}") from k_err

    def add_metric_to_cache(
        self,
        metric_name: str,
        unit: str,
        dimension_names: list[str] | None = [],  # noqa: B006 (TorchServe's; read only)
        metric_type: MetricTypes = MetricTypes.COUNTER,
    ) -> CachingMetric:
        self._check_type(metric_name, str, "`metric_name` must be a str")
        self._check_type(unit, str, "`unit` must be a str")
        kind = self._metric_type(metric_type)
        if dimension_names:
            self._check_type(dimension_names, list,
                             "`dimension_names` should be a list of dimension name strings")
        metric = CachingMetric(metric_name=metric_name, unit=unit,
                               dimension_names=dimension_names, metric_type=kind)
        metric.sink = self.sink
        by_name = self.cache.setdefault(kind, {})
        if metric_name in by_name:
            logger.warning("Overriding existing key %s:%s", kind, metric_name)
        by_name[metric_name] = metric
        return metric

    def get_metric(
        self,
        metric_name: str,
        metric_type: MetricTypes = MetricTypes.COUNTER,
    ) -> CachingMetric:
        self._check_type(metric_name, str, "`metric_name` must be a str")
        kind = self._metric_type(metric_type)
        try:
            metric = self.cache[kind][metric_name]
        except KeyError:
            raise merrors.MetricsCacheKeyError(
                f"Metric of type '{kind}' and name '{metric_name}' doesn't exist") from None
        assert isinstance(metric, CachingMetric)
        return metric

    def cache_keys(self) -> list[str]:
        """``"type:name"`` of every metric in the cache."""
        return [f"{kind.value}:{name}" for kind, metrics in self.cache.items()
                for name in metrics]
