"""TorchServe 0.12's handler metrics API (``context.metrics``, ``ts.metrics.*``) in the worker:
the dimensions TorchServe adds, its errors, its older objects, and what reaches the frontend
(each reported value, in the batch's result)."""

from __future__ import annotations

import enum
import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.compat import install_torchserve_shim
from backend.context import Context
from backend.metrics.cache import MetricsCacheYamlImpl
from backend.metrics.caching import CachingMetric
from backend.metrics.dimension import Dimension
from backend.metrics.errors import (
    MetricsCacheKeyError,
    MetricsCacheTypeError,
    MetricsCacheValueError,
)
from backend.metrics.legacy import Metric, MetricEncoder, MetricsStore
from backend.metrics.sink import DEFAULT_SINK
from backend.metrics.types import MetricTypes
from backend.service.model_service import model_metrics
from protos import worker_pb2
from tests.unit.imports import forget_modules

DEFAULT_METRICS_YAML = Path(__file__).resolve().parents[2] / "frontend" / "observe" / \
    "metrics.yaml"

#: The public names of TorchServe 0.12's ts/metrics modules (pytorch/serve v0.12.0, the
#: classes, functions and module-level values each defines or imports; modules left out).
TORCHSERVE_NAMES = {
    "caching_metric": {"CachingMetric", "Dimension", "MetricAbstract", "MetricTypes", "logger"},
    "dimension": {"Dimension"},
    "metric": {"CachingMetric", "Metric", "MetricTypes", "MetricUnit", "OrderedDict", "Units"},
    "metric_abstract": {"MetricAbstract", "MetricTypes", "MetricUnit", "Units"},
    "metric_cache_abstract": {"Dimension", "MetricAbstract", "MetricCacheAbstract",
                              "MetricTypes"},
    "metric_cache_errors": {"GeneralMetricsCacheError", "MetricsCacheIOError",
                            "MetricsCacheKeyError", "MetricsCachePyYamlError",
                            "MetricsCacheTypeError", "MetricsCacheValueError"},
    "metric_cache_yaml_impl": {"CachingMetric", "MetricCacheAbstract", "MetricTypes",
                               "MetricsCacheYamlImpl", "logger"},
    "metric_collector": {"check_process_mem_usage"},
    "metric_encoder": {"Dimension", "JSONEncoder", "Metric", "MetricEncoder"},
    "metric_type_enum": {"MetricTypes"},
    "metrics_store": {"Dimension", "Metric", "MetricsStore"},
    "process_memory_metric": {"check_process_mem_usage", "get_cpu_usage"},
    "system_metrics": {"Dimension", "Metric", "collect_all", "gpu_utilization",
                       "cpu_utilization", "dimension", "disk_available", "disk_used",
                       "disk_utilization", "memory_available", "memory_used",
                       "memory_utilization", "system_metrics"},
    "unit": {"Units"},
}


@pytest.fixture
def cache() -> MetricsCacheYamlImpl:
    """A model's context.metrics as the worker makes it from TorchServe's metrics.yaml."""
    metrics = model_metrics(str(DEFAULT_METRICS_YAML), "m")
    metrics.sink.drain()
    return metrics


def reported(cache: MetricsCacheYamlImpl) -> list[tuple[str, str, str, float, dict[str, str], str]]:
    return [(m.name, m.unit, m.type, m.value,
             dict(zip(m.dimension_names, m.dimension_values, strict=True)), m.request_id)
            for m in cache.sink.drain()]


def test_the_ts_metrics_modules_have_torchserve_names(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    if not install_torchserve_shim():
        pytest.skip("a real TorchServe `ts` package is installed; the shim stays unused")
    try:
        for module, names in TORCHSERVE_NAMES.items():
            loaded = importlib.import_module(f"ts.metrics.{module}")
            assert names <= set(dir(loaded)), f"ts.metrics.{module} lacks " \
                f"{sorted(names - set(dir(loaded)))}"
        # One class whichever way it is imported: the handler's enum is the cache's.
        assert importlib.import_module("ts.metrics.metric_type_enum").MetricTypes is MetricTypes
        errors = importlib.import_module("ts.metrics.metric_cache_errors")
        assert errors.MetricsCacheKeyError is MetricsCacheKeyError
    finally:
        forget_modules(tmp_path, "ts")


def test_add_shortcuts_report_with_torchserve_dimensions(cache: MetricsCacheYamlImpl) -> None:
    cache.set_request_ids({0: "a", 1: "b"})
    cache.add_counter("Calls", 2, idx=1, dimensions=[Dimension("Kind", "x")])
    cache.add_time("Took", 1.5)
    cache.add_size("Bytes", 3, None, "kB")
    cache.add_percent("Ratio", 50, None, [], MetricTypes.HISTOGRAM)
    cache.add_metric("Anything", 7, "widgets", None, [], MetricTypes.GAUGE)
    cache.add_error("Oops", 1)
    assert reported(cache) == [
        ("Calls", "Count", "counter", 2.0, {"Kind": "x", "ModelName": "m", "Level": "Model"},
         "b"),
        ("Took", "Milliseconds", "gauge", 1.5, {"ModelName": "m", "Level": "Model"}, "a,b"),
        ("Bytes", "Kilobytes", "gauge", 3.0, {"ModelName": "m", "Level": "Model"}, "a,b"),
        ("Ratio", "Percent", "histogram", 50.0, {"ModelName": "m", "Level": "Model"}, "a,b"),
        ("Anything", "widgets", "gauge", 7.0, {"ModelName": "m", "Level": "Model"}, "a,b"),
        ("Oops", "unit", "counter", 1.0, {"Level": "Error"}, ""),
    ]


def test_declared_metrics_keep_their_declaration(cache: MetricsCacheYamlImpl) -> None:
    # TorchServe's metrics.yaml declares HandlerTime: a gauge, [ModelName, Level], in ms.
    handler_time = cache.get_metric("HandlerTime", MetricTypes.GAUGE)
    assert (handler_time.unit, handler_time.dimension_names) == ("Milliseconds",
                                                                ["ModelName", "Level"])
    cache.set_request_ids({0: "r"})
    cache.add_time("HandlerTime", 12.5, None, "ms")
    assert reported(cache) == [
        ("HandlerTime", "Milliseconds", "gauge", 12.5, {"ModelName": "m", "Level": "Model"},
         "r")]
    assert "gauge:PredictionTime" in cache.cache_keys()


def test_metric_objects_from_the_cache(cache: MetricsCacheYamlImpl) -> None:
    declared = cache.add_metric_to_cache("Hits", "count", ["Route"], MetricTypes.COUNTER)
    assert cache.get_metric("Hits", MetricTypes.COUNTER) is declared
    declared.add_or_update(3, ["a"], "req")
    declared.add_or_update(-1, ["a"])  # a counter never goes down: logged, not reported
    declared.add_or_update(1, ["a", "b"])  # one value per dimension: logged, not reported
    declared.add_or_update(float("nan"), ["a"])  # not a number TorchServe could read
    declared.update(4, "req2", [Dimension("Other", "z")])  # older API: new dimension names
    assert reported(cache) == [("Hits", "Count", "counter", 3.0, {"Route": "a"}, "req"),
                               ("Hits", "Count", "counter", 4.0, {"Other": "z"}, "req2")]
    with pytest.raises(MetricsCacheKeyError):
        cache.get_metric("Hits", MetricTypes.GAUGE)  # by name and type
    with pytest.raises(MetricsCacheValueError):
        cache.add_time("T", 1, unit="minutes")
    with pytest.raises(ValueError):
        cache.add_size("S", 1, unit="TB")
    with pytest.raises(MetricsCacheTypeError):
        cache.add_metric_to_cache(5, "count")  # type: ignore[arg-type]


def test_another_copy_of_the_metric_types_is_taken_by_value(cache: MetricsCacheYamlImpl) -> None:
    """A real TorchServe installed beside us has its own MetricTypes: its members work."""

    class TheirMetricTypes(enum.Enum):
        COUNTER = "counter"
        GAUGE = "gauge"
        HISTOGRAM = "histogram"

    cache.add_metric_to_cache("Theirs", "count", [], TheirMetricTypes.GAUGE)  # type: ignore[arg-type]
    cache.get_metric("Theirs", TheirMetricTypes.GAUGE).add_or_update(2, [])  # type: ignore[arg-type]
    assert reported(cache) == [("Theirs", "Count", "gauge", 2.0, {}, "")]


def test_initialize_reports_go_with_loaded_and_carry_a_request_id(tmp_path: Path) -> None:
    cache = model_metrics(str(DEFAULT_METRICS_YAML), "m")
    context = Context("m", str(tmp_path), {}, 1, None, "0.1.0", metrics=cache)
    context.metrics.add_metric("InitializeCallCount", 1, "count")
    [metric] = cache.sink.drain()
    assert (list(metric.dimension_names), list(metric.dimension_values)) == (
        ["ModelName", "Level"], ["m", "Model"])
    assert len(metric.request_id) == 36  # TorchServe's load-time uuid


def test_a_config_without_model_metrics_declares_none(tmp_path: Path) -> None:
    config = tmp_path / "metrics.yaml"
    config.write_text("ts_metrics: {}\n")
    cache = model_metrics(str(config), "m")  # TorchServe's worker would not start
    assert cache.cache_keys() == []
    assert model_metrics("", "m").cache_keys() == []


def test_older_metric_objects_report_too() -> None:
    DEFAULT_SINK.drain()
    store = MetricsStore({0: "r0"}, "m")
    store.add_counter("Old", 1, idx=0)
    store.add_counter("Old", 2, idx=0)
    Metric("Single", 5, "ms", [Dimension("Level", "Host")]).update(6)
    assert [(m.name, m.value, list(m.dimension_values)) for m in DEFAULT_SINK.drain()] == [
        ("Old", 1.0, ["m", "Model"]), ("Old", 2.0, ["m", "Model"]), ("Single", 6.0, ["Host"])]
    assert len(store.store) == 1
    encoded = json.loads(json.dumps(store.store[0], cls=MetricEncoder))
    assert encoded["MetricName"] == "Old" and encoded["Dimensions"][0] == {
        "Name": "ModelName", "Value": "m"}
    assert str(Metric("X", 1, "count", [Dimension("A", "b")])).startswith("X.Count:1|#A:b|")


def test_a_standalone_caching_metric_reaches_the_default_sink() -> None:
    DEFAULT_SINK.drain()
    CachingMetric("Own", "ms", ["D"], MetricTypes.GAUGE).add_or_update(1, ["v"])
    [metric] = DEFAULT_SINK.drain()
    assert isinstance(metric, worker_pb2.Metric) and metric.unit == "Milliseconds"


def test_text_a_protobuf_string_cannot_carry_still_reaches_the_frontend(
        cache: MetricsCacheYamlImpl) -> None:
    """A client's bytes decoded with ``surrogateescape`` put in a dimension failed the batch's
    whole result frame (protobuf takes only valid UTF-8)."""
    cache.add_metric("Text\udc80", 1, "count", None, [Dimension("Said", "caf\udce9 \u00e9")])
    CachingMetric("Own", "ms", [1], MetricTypes.GAUGE).add_or_update(1, [b"x"])
    [text] = cache.sink.drain()
    assert text.name == "Text?" and text.dimension_values[0] == "caf? \u00e9"
    assert worker_pb2.Metric.FromString(text.SerializeToString()) == text
    [own] = DEFAULT_SINK.drain()
    assert list(own.dimension_names) == ["1"] and list(own.dimension_values) == ["b'x'"]


@pytest.fixture(autouse=True)
def _no_leftovers() -> Iterator[None]:
    yield
    DEFAULT_SINK.drain()
