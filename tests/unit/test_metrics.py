"""The metrics page: TorchServe's families exactly as TorchServe writes them (names, types,
units, labels and their order, its Java client's text), handlers' metrics, the metric logs,
and the server's own histograms (plain counts on the request path, text when read)."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from frontend.errors import ConfigError
from frontend.observe import families
from frontend.observe.events import Batch, CallFacts, JobFacts, Observers, Origin
from frontend.observe.exposition import Family, java_double, render
from frontend.observe.histograms import Histogram as _Histogram
from frontend.observe.metric_specs import MetricSpec, load_metrics_config
from frontend.observe.metrics import HOSTNAME, ServerMetrics
from frontend.observe.status import ModelStatus
from frontend.observe.system import SystemSampler, parse_nvidia_smi
from protos import worker_pb2

BOUNDS = (0.001, 0.01, 0.1, 1.0)
VALUES = (0.0005, 0.001, 0.002, 0.05, 0.1, 0.7, 3.0, 12.5)


def _samples(text: bytes, name: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text.decode()):
        if family.name == name:
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_a_histogram_reads_as_prometheus_client_would_write_it() -> None:
    ours = _Histogram("t_seconds", "a test histogram", BOUNDS)
    reference = CollectorRegistry()
    theirs = Histogram("t_seconds", "a test histogram", ["model_name", "model_version"],
                       buckets=BOUNDS, registry=reference)
    for value in VALUES:  # boundary values go in their own bucket (le: less or equal)
        ours.observe(("m", "1.0"), value)
        theirs.labels("m", "1.0").observe(value)
    ours.observe(("n", "2.0"), 0.2)
    theirs.labels("n", "2.0").observe(0.2)
    assert _samples(render([ours.family()]), "t_seconds") == \
        _samples(generate_latest(reference), "t_seconds")


def test_bucket_counts_are_cumulative_with_count_and_sum() -> None:
    histogram = _Histogram("t", "t", BOUNDS)
    for value in VALUES:
        histogram.observe(("m", "1.0"), value)
    samples = _samples(render([histogram.family()]), "t")
    labels = (("model_name", "m"), ("model_version", "1.0"))
    buckets = {dict(key)["le"]: value for (name, key), value in samples.items()
               if name == "t_bucket"}
    assert buckets == {"0.001": 2, "0.01": 3, "0.1": 5, "1.0": 6, "+Inf": 8}
    assert samples[("t_count", labels)] == 8
    assert abs(samples[("t_sum", labels)] - sum(VALUES)) < 1e-9


def test_an_unobserved_histogram_has_no_series() -> None:
    assert _samples(render([_Histogram("t", "t", BOUNDS).family()]), "t") == {}


# ---- TorchServe's families, exactly ------------------------------------------------------------

#: Every family of TorchServe 0.12's default metrics.yaml (pytorch/serve v0.12.0,
#: ts/configs/metrics.yaml): type, unit and labels in TorchServe's order (model metrics end
#: with the Hostname its frontend adds).
TORCHSERVE_FAMILIES = {
    "Requests2XX": ("counter", "Count", ("Level", "Hostname")),
    "Requests4XX": ("counter", "Count", ("Level", "Hostname")),
    "Requests5XX": ("counter", "Count", ("Level", "Hostname")),
    "ts_inference_requests_total": ("counter", "Count",
                                    ("model_name", "model_version", "hostname")),
    "ts_inference_latency_microseconds": ("counter", "Microseconds",
                                          ("model_name", "model_version", "hostname")),
    "ts_queue_latency_microseconds": ("counter", "Microseconds",
                                      ("model_name", "model_version", "hostname")),
    "QueueTime": ("gauge", "Milliseconds", ("Level", "Hostname")),
    "WorkerThreadTime": ("gauge", "Milliseconds", ("Level", "Hostname")),
    "WorkerLoadTime": ("gauge", "Milliseconds", ("WorkerName", "Level", "Hostname")),
    "CPUUtilization": ("gauge", "Percent", ("Level", "Hostname")),
    "MemoryUsed": ("gauge", "Megabytes", ("Level", "Hostname")),
    "MemoryAvailable": ("gauge", "Megabytes", ("Level", "Hostname")),
    "MemoryUtilization": ("gauge", "Percent", ("Level", "Hostname")),
    "DiskUsage": ("gauge", "Gigabytes", ("Level", "Hostname")),
    "DiskUtilization": ("gauge", "Percent", ("Level", "Hostname")),
    "DiskAvailable": ("gauge", "Gigabytes", ("Level", "Hostname")),
    "GPUMemoryUtilization": ("gauge", "Percent", ("Level", "DeviceId", "Hostname")),
    "GPUMemoryUsed": ("gauge", "Megabytes", ("Level", "DeviceId", "Hostname")),
    "GPUUtilization": ("gauge", "Percent", ("Level", "DeviceId", "Hostname")),
    "HandlerTime": ("gauge", "ms", ("ModelName", "Level", "Hostname")),
    "PredictionTime": ("gauge", "ms", ("ModelName", "Level", "Hostname")),
}
#: A TorchServe sample line with its labels (TorchServe's own test data's shape).
SAMPLE = re.compile(r'^(\w+)\{((?:\w+="[^"]*",)+)\} (\S+)$')


#: The model version the tests record for, and what its gauges read of it.
KEY = ("m", "1.0")
STATUS = ModelStatus("m", "1.0", "Healthy", "adaptive", 1, 0, 0, 100)


def _subscribed(metrics: ServerMetrics) -> Observers:
    """The events the metrics observe, subscribed as the server subscribes them, with m 1.0
    registered."""
    observers = Observers()
    metrics.subscribe(observers)
    observers.registered(*KEY)
    return observers


def _answered(latency_s: float, version: str | None = None) -> CallFacts:
    """A prediction of m 1.0 (naming ``version``) a worker answered, 4.2 ms in the queue."""
    job = JobFacts(worker_pb2.Request(), enqueued_at=0.0,
                   batch=Batch("full", 1, 1, 0.0042, 0.0))
    call = CallFacts(Origin("/127.0.0.1:1", "POST", "/predictions/m", "HTTP/1.1"), job, 0.0)
    call.key, call.version, call.latency_s, call.status = KEY, version, latency_s, 200
    return call


def _record_request(metrics: ServerMetrics, call: CallFacts) -> None:
    """Tell the metrics a call ended, as the inference plane tells its observers."""
    for observer in _subscribed(metrics).call_ended:
        observer(call)


def _metric(name: str, value: float, kind: str = "counter", unit: str = "Count",
            **dimensions: str) -> worker_pb2.Metric:
    return worker_pb2.Metric(name=name, unit=unit, type=kind, value=value,
                             dimension_names=list(dimensions),
                             dimension_values=list(dimensions.values()), request_id="r1")


def test_every_torchserve_family_with_its_type_unit_and_label_order() -> None:
    metrics = ServerMetrics(lambda: [STATUS], system_metrics=False)
    _record_request(metrics, _answered(0.01))
    _record_request(metrics, _answered(0.01, version="1.0"))
    metrics.count_response(200)
    metrics.count_response(404)
    metrics.count_response(503)
    metrics.worker_loaded("W-9000-m_1.0", 1234.5)
    metrics.batch_overhead(1.7)
    metrics.record_system(SystemSampler().read())
    metrics.record_model_metrics([
        _metric("HandlerTime", 3.25, "gauge", "Milliseconds", ModelName="m", Level="Model"),
        _metric("PredictionTime", 3.5, "gauge", "Milliseconds", ModelName="m", Level="Model")])
    text = metrics.exposition().decode()

    for name, (kind, unit, labels) in TORCHSERVE_FAMILIES.items():
        assert f"# HELP {name} Torchserve prometheus {kind} metric with unit: {unit}\n" \
               f"# TYPE {name} {kind}\n" in text, name
        for line in text.splitlines():
            match = SAMPLE.match(line)
            if match and match[1] == name:
                assert tuple(pair.split("=")[0] for pair in match[2].split(",")[:-1]) == labels
    lines = set(text.splitlines())
    assert f'Requests2XX{{Level="Host",Hostname="{HOSTNAME}",}} 1.0' in lines
    assert f'Requests5XX{{Level="Host",Hostname="{HOSTNAME}",}} 1.0' in lines
    assert f'ts_inference_requests_total{{model_name="m",model_version="default",' \
           f'hostname="{HOSTNAME}",}} 1.0' in lines
    assert f'ts_inference_requests_total{{model_name="m",model_version="1.0",' \
           f'hostname="{HOSTNAME}",}} 1.0' in lines
    assert f'ts_queue_latency_microseconds{{model_name="m",model_version="default",' \
           f'hostname="{HOSTNAME}",}} 4200.0' in lines
    assert f'QueueTime{{Level="Host",Hostname="{HOSTNAME}",}} 4.0' in lines  # whole ms
    assert f'WorkerLoadTime{{WorkerName="W-9000-m_1.0",Level="Host",Hostname="{HOSTNAME}",}}' \
           f' 1234.0' in lines
    assert f'HandlerTime{{ModelName="m",Level="Model",Hostname="{HOSTNAME}",}} 3.25' in lines
    # prometheus_client reads the whole page, and types every family.
    families = list(text_string_to_metric_families(text))
    assert [f.name for f in families if f.type in ("unknown", "untyped")] == []


def test_java_doubles() -> None:
    assert [java_double(v) for v in (0.0, 1.0, 17.63, 4315280.097, 1e7, 12345678.0, 2.5e-4,
                                      -3.0, 0.001, float("inf"), float("-inf"))] == [
        "0.0", "1.0", "17.63", "4315280.097", "1.0E7", "1.2345678E7", "2.5E-4", "-3.0",
        "0.001", "+Inf", "-Inf"]
    assert java_double(float("nan")) == "NaN"


def test_label_values_are_escaped_and_a_family_without_labels_has_none() -> None:
    family = Family("X", "help with \\ and\nnewline", "gauge")
    family.add(("a",), ('q"uo\\te\nx',), 1.0)
    family.add((), (), 2.0)
    text = render([family]).decode()
    assert text == ('# HELP X help with \\\\ and\\nnewline\n# TYPE X gauge\n'
                    'X{a="q\\"uo\\\\te\\nx",} 1.0\nX 2.0\n')
    [parsed] = text_string_to_metric_families(text)
    assert [s.labels for s in parsed.samples] == [{"a": 'q"uo\\te\nx'}, {}]


def test_handler_metrics_not_declared_are_kept_only_with_auto_detect(
        caplog: pytest.LogCaptureFixture) -> None:
    strict = ServerMetrics(system_metrics=False)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            strict.record_model_metrics([_metric("Undeclared", 1, Level="Model")])
    assert b"Undeclared" not in strict.exposition()
    assert sum("Undeclared" in r.getMessage() for r in caplog.records) == 1

    detecting = ServerMetrics(system_metrics=False, auto_detect=True)
    detecting.record_model_metrics([_metric("Undeclared", 1, Level="Model"),
                                    _metric("Undeclared", 2, Level="Model"),
                                    _metric("bad name", 1), _metric("Typeless", 1, kind="")])
    text = detecting.exposition().decode()
    assert f'Undeclared{{Level="Model",Hostname="{HOSTNAME}",}} 3.0' in text
    assert "bad name" not in text and "Typeless" not in text


def test_updates_a_metric_cannot_keep_are_refused() -> None:
    metrics = ServerMetrics(system_metrics=False)
    # Declared [ModelName, Level] (+ Hostname): a value per dimension, or nothing.
    metrics.record_model_metrics([_metric("HandlerTime", 1.0, "gauge", ModelName="m")])
    assert b"\nHandlerTime{" not in metrics.exposition()
    counter = families.build(MetricSpec("C", "Count", "counter", ("A",)), "prometheus", ())
    counter.add(("x",), 2.0)
    counter.add(("x",), -1.0)  # a counter never goes down
    family = counter.family()
    assert family is not None and family.samples == [("C", ("A",), ("x",), 2.0)]


def test_a_metric_keeps_at_most_its_cap_of_label_sets(caplog: pytest.LogCaptureFixture) -> None:
    gauge = families.build(MetricSpec("G", "Count", "gauge", ("Id",)), "prometheus", ())
    with caplog.at_level(logging.WARNING):
        for number in range(families.MAX_LABEL_SETS + 50):
            gauge.add((str(number),), 1.0)
    gauge.add(("0",), 5.0)  # those it has are still updated
    family = gauge.family()
    assert family is not None and len(family.samples) == families.MAX_LABEL_SETS
    assert family.samples[0][3] == 5.0
    assert len(caplog.records) == 1


def test_histograms_use_simpleclients_default_buckets() -> None:
    histogram = families.build(MetricSpec("H", "Percent", "histogram", ("L",)), "prometheus", ())
    for value in (0.005, 0.3, 50.0):
        histogram.add(("x",), value)
    family = histogram.family()
    assert family is not None
    buckets = {values[-1]: value for name, _, values, value in family.samples
               if name == "H_bucket"}
    assert list(buckets) == ["0.005", "0.01", "0.025", "0.05", "0.075", "0.1", "0.25", "0.5",
                             "0.75", "1.0", "2.5", "5.0", "7.5", "10.0", "+Inf"]
    assert (buckets["0.005"], buckets["0.5"], buckets["10.0"], buckets["+Inf"]) == (1, 2, 2, 3)
    assert [name for name, *_ in family.samples[-2:]] == ["H_count", "H_sum"]


def test_legacy_mode_shows_only_the_three_ts_counters(tmp_path: Path) -> None:
    metrics = ServerMetrics(lambda: [STATUS], mode="legacy", system_metrics=False,
                            log_dir=tmp_path)
    asyncio.run(_start_and_close(metrics, lambda: _record_some(metrics)))
    names = {f.name for f in text_string_to_metric_families(metrics.exposition().decode())}
    assert names == {"ts_inference_requests", "ts_inference_latency_microseconds",
                     "ts_queue_latency_microseconds"}
    logged = (tmp_path / "ts_metrics.log").read_text()
    assert "Requests2XX.Count:1.0|#Level:Host|" in logged
    assert "ts_inference_requests_total" not in logged


def test_log_mode_writes_torchserve_lines(tmp_path: Path) -> None:
    metrics = ServerMetrics(lambda: [STATUS], mode="log", system_metrics=False,
                            log_dir=tmp_path)
    asyncio.run(_start_and_close(metrics, lambda: _record_some(metrics)))
    assert b"Requests2XX" not in metrics.exposition()
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d{3} - "
    host = re.escape(HOSTNAME)
    ts_lines = (tmp_path / "ts_metrics.log").read_text().splitlines()
    expected_ts = [
        rf"Requests2XX\.Count:1\.0\|#Level:Host\|#hostname:{host},timestamp:\d+",
        rf"ts_inference_requests_total\.Count:1\.0\|#model_name:m,model_version:default"
        rf"\|#hostname:{host},timestamp:\d+",
        rf"ts_inference_latency_microseconds\.Microseconds:10000\.0\|#model_name:m,"
        rf"model_version:default\|#hostname:{host},timestamp:\d+",
        rf"ts_queue_latency_microseconds\.Microseconds:4200\.0\|#model_name:m,"
        rf"model_version:default\|#hostname:{host},timestamp:\d+",
        rf"QueueTime\.Milliseconds:4\.0\|#Level:Host\|#hostname:{host},timestamp:\d+",
    ]
    assert len(ts_lines) == len(expected_ts)
    for line, pattern in zip(ts_lines, expected_ts, strict=True):
        assert re.fullmatch(stamp + pattern, line), line
    [model_line] = (tmp_path / "model_metrics.log").read_text().splitlines()
    assert re.fullmatch(stamp + rf"HandlerTime\.ms:3\.25\|#ModelName:m,Level:Model\|"
                        rf"#hostname:{host},requestID:r1,timestamp:\d+", model_line), model_line


def _record_some(metrics: ServerMetrics) -> None:
    metrics.count_response(200)
    _record_request(metrics, _answered(0.01))
    metrics.record_model_metrics([
        _metric("HandlerTime", 3.25, "gauge", "Milliseconds", ModelName="m", Level="Model")])


async def _start_and_close(metrics: ServerMetrics, work: Callable[[], None]) -> None:
    await metrics.start()
    work()
    await metrics.close()


def test_a_metrics_config_is_read_with_torchserves_rules(tmp_path: Path) -> None:
    config = load_metrics_config()
    assert list(config.ts_metrics) == [name for name, (kind, *_) in TORCHSERVE_FAMILIES.items()
                                       if name not in ("HandlerTime", "PredictionTime")]
    assert config.model_metrics["HandlerTime"] == MetricSpec(
        "HandlerTime", "ms", "gauge", ("ModelName", "Level", "Hostname"))
    bad = {
        "ts_metrics: {summary: []}": "unknown metric type",
        "model_metrics: {counter: [{name: A, dimensions: []}]}": "needs a unit",
        "model_metrics: {counter: [{name: A, unit: c}]}": "needs its dimensions",
        "model_metrics: {counter: [{name: A, unit: c, dimensions: [], colour: red}]}":
            "unknown key",
        "other: 1": "unknown key",
        "- a": "expected a mapping",
        "a: [": "not YAML",
    }
    for text, message in bad.items():
        path = tmp_path / "m.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_metrics_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_metrics_config(tmp_path / "none.yaml")
    path.write_text("ts_metrics: {gauge: [{name: bad-name, unit: c, dimensions: []}]}")
    with pytest.raises(ConfigError, match="not a Prometheus metric name"):
        ServerMetrics(config=load_metrics_config(path), system_metrics=False)
    ServerMetrics(mode="log", config=load_metrics_config(path), system_metrics=False)


def test_gpu_readings_degrade_cleanly() -> None:
    text = "0, 35, 12, 2048\n1, [N/A], 3, 100\n"
    assert parse_nvidia_smi(text, [1, 0]) == [
        ("GPUMemoryUtilization", ("Host", "0"), 3.0), ("GPUMemoryUsed", ("Host", "0"), 100.0),
        ("GPUUtilization", ("Host", "1"), 35.0), ("GPUMemoryUtilization", ("Host", "1"), 12.0),
        ("GPUMemoryUsed", ("Host", "1"), 2048.0)]
    # Here no GPU, or no way to read one: the host's readings only, nothing raised.
    names = [name for name, *_ in SystemSampler(gpu_count=2).read()]
    assert names[:7] == ["CPUUtilization", "MemoryUsed", "MemoryAvailable", "MemoryUtilization",
                         "DiskUsage", "DiskUtilization", "DiskAvailable"]


def test_torchserve_request_metrics_follow_the_types_their_config_declares(
        tmp_path: Path) -> None:
    path = tmp_path / "metrics.yaml"
    path.write_text("""
ts_metrics:
  histogram:
    - {name: QueueTime, unit: Milliseconds, dimensions: [Level, Hostname]}
    - {name: ts_inference_latency_microseconds, unit: Microseconds,
       dimensions: [model_name, model_version, hostname]}
  gauge:
    - {name: ts_inference_requests_total, unit: Count,
       dimensions: [model_name, model_version, hostname]}
""")
    metrics = ServerMetrics(config=load_metrics_config(path), system_metrics=False)
    for _ in range(2):
        _record_request(metrics, _answered(0.01))
        metrics.count_response(200)  # Requests2XX is not declared: not counted
    text = metrics.exposition().decode()
    parsed = {sample.name: sample.value for family in text_string_to_metric_families(text)
              for sample in family.samples if "le" not in sample.labels}
    assert parsed["QueueTime_count"] == 2 and parsed["QueueTime_sum"] == 8.0
    assert parsed["ts_inference_latency_microseconds_count"] == 2
    assert parsed["ts_inference_requests_total"] == 1.0  # a gauge keeps the last value
    assert "Requests2XX" not in text and "ts_queue_latency_microseconds" not in text


def test_phases_and_dispatch_stats_off_give_no_samples() -> None:
    metrics = ServerMetrics(lambda: [STATUS], system_metrics=False, phases=False,
                            dispatch_stats=False)
    observers = _subscribed(metrics)
    events = observers.of_model(*KEY)
    assert events.formed is None  # nobody is told of a batch leaving its queue
    call = _answered(0.02)
    batch, result = call.job.batch, worker_pb2.PredictResult(handler_time_ms=5.0)
    assert batch is not None and events.ended is not None
    metrics.records.batch_formed(KEY, batch)  # told anyway: counts nothing
    batch.replied, batch.ended_at = True, batch.left_at + 0.01
    batch.note_reply(result)
    events.ended(batch, [call.job], result)
    for observer in observers.call_ended:
        observer(call)
    page = metrics.exposition().decode()
    assert "batchserve_request_latency_seconds_count" in page
    for family in ("batchserve_request_phase_seconds", "batchserve_dispatch_total",
                   "batchserve_batch_fill"):
        assert f"\n{family}" not in page and f"\n{family}_" not in page, family
