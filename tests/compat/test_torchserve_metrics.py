"""TorchServe's metrics, end to end: a handler written to TorchServe 0.12's metrics API
(tests/fixtures/ts_handlers/metrics_reporter.py), archived by TorchServe's own
torch-model-archiver, served by two workers; the page read as TorchServe's own tests read it
(their regular expressions) and as Prometheus reads it (prometheus_client's parser).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from frontend.observe.families import MAX_LABEL_SETS
from tests.compat.test_torchserve_archives import TS_ARCHIVER, torchserve_archive
from tests.conftest import ROOT, RunningServer, launch_server

pytestmark = pytest.mark.skipif(not TS_ARCHIVER.exists(),
                                reason="run `make test` to install torch-model-archiver 0.12")

TS_HANDLERS = ROOT / "tests" / "fixtures" / "ts_handlers"
METRICS_YAML = TS_HANDLERS / "metrics.yaml"
MODEL = "reporter"

#: The lines TorchServe's own test of its prometheus mode looks for (pytorch/serve v0.12.0,
#: test/pytest/test_metrics.py, test_metrics_prometheus_mode and
#: test_auto_detect_backend_metrics_prometheus_mode), with this test's model and metrics:
#: each must match exactly once.
TORCHSERVE_PATTERNS = [
    r"TYPE Requests2XX counter",
    r'Requests2XX\{Level="Host",Hostname=".+",\} \d+\.\d+',
    r"TYPE ts_inference_requests_total counter",
    r'ts_inference_requests_total\{model_name="reporter",model_version="default",'
    r'hostname=".+",\} \d+\.\d+',
    r"TYPE ts_inference_latency_microseconds counter",
    r'ts_inference_latency_microseconds\{model_name="reporter",model_version="default",'
    r'hostname=".+",\} \d+\.\d+',
    r"TYPE ts_queue_latency_microseconds counter",
    r'ts_queue_latency_microseconds\{model_name="reporter",model_version="default",'
    r'hostname=".+",\} \d+\.\d+',
    r"TYPE QueueTime gauge",
    r'QueueTime\{Level="Host",Hostname=".+",\} \d+\.\d+',
    r"TYPE WorkerThreadTime gauge",
    r'WorkerThreadTime\{Level="Host",Hostname=".+",\} \d+\.\d+',
    r"TYPE WorkerLoadTime gauge",
    r"TYPE CPUUtilization gauge",
    r'CPUUtilization\{Level="Host",Hostname=".+",\} \d+\.\d+',
    r"TYPE MemoryUsed gauge",
    r'MemoryUsed\{Level="Host",Hostname=".+",\} \d+\.\d+',
    r"TYPE MemoryAvailable gauge",
    r'MemoryAvailable\{Level="Host",Hostname=".+",\} \d+\.\d+',
    r"TYPE MemoryUtilization gauge",
    r'MemoryUtilization\{Level="Host",Hostname=".+",\} \d+\.\d+',
    r"TYPE DiskUsage gauge",
    r'DiskUsage\{Level="Host",Hostname=".+",\} \d+\.\d+',
    r"TYPE DiskUtilization gauge",
    r'DiskUtilization\{Level="Host",Hostname=".+",\} \d+\.\d+',
    r"TYPE DiskAvailable gauge",
    r'DiskAvailable\{Level="Host",Hostname=".+",\} \d+\.\d+',
    r"TYPE PredictionTime gauge",
    r'PredictionTime\{ModelName="reporter",Level="Model",Hostname=".+",\} \d+\.\d+',
    # The handler's: declared in metrics.yaml...
    r"TYPE ReporterRequests counter",
    r'ReporterRequests\{Hostname=".+",\} \d+\.\d+',
    r"TYPE ReporterLoads counter",
    r'ReporterLoads\{ModelName="reporter",Level="Model",Hostname=".+",\} \d+\.\d+',
    r"TYPE ReporterBatchSize gauge",
    r'ReporterBatchSize\{ModelName="reporter",Hostname=".+",\} \d+\.\d+',
    # ... and auto-detected, with the type, unit and dimensions they were reported with.
    r"TYPE ReporterTime gauge",
    r'ReporterTime\{Step="handle",ModelName="reporter",Level="Model",Hostname=".+",\} '
    r"\d+\.\d+",
    r"TYPE ReporterBytes gauge",
    r'ReporterBytes\{ModelName="reporter",Level="Model",Hostname=".+",\} \d+\.\d+',
    r"TYPE ReporterRatio histogram",
    r'ReporterRatio_sum\{ModelName="reporter",Level="Model",Hostname=".+",\} \d+\.\d+',
    r'ReporterRatio_count\{ModelName="reporter",Level="Model",Hostname=".+",\} \d+\.\d+',
    r'ReporterErrors\{Level="Error",Hostname=".+",\} \d+\.\d+',
    r'ReporterLookupsMissed\{ModelName="reporter",Level="Model",Hostname=".+",\} \d+\.\d+',
]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_store = tmp_path_factory.mktemp("store")
    torchserve_archive(model_store, MODEL, "--handler", str(TS_HANDLERS / "metrics_reporter.py"))
    return model_store


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[RunningServer]:
    """Prometheus mode, the test's metrics.yaml, auto-detection on, two workers."""
    running = launch_server(store, f"{MODEL}={MODEL}.mar", metrics_config=METRICS_YAML,
                            model_metrics_auto_detect=True, default_workers_per_model=2,
                            log_location=store.parent / "prometheus-logs")
    yield running
    running.stop()


def _page(server: RunningServer, query: str = "") -> str:
    answer = requests.get(f"{server.metrics}/metrics{query}", timeout=10)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return answer.text


def _series(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples named ``name``, by their labels without the host name."""
    return {tuple((k, v) for k, v in sample.labels.items() if k.lower() != "hostname"):
            sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == name}


def _predict(server: RunningServer, body: bytes, version: str = "") -> str:
    path = f"{MODEL}/{version}" if version else MODEL
    answer = requests.post(f"{server.inference}/predictions/{path}", data=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.text


def test_handler_and_server_metrics_read_as_torchserve_and_prometheus_read_them(
        server: RunningServer) -> None:
    with ThreadPoolExecutor(4) as pool:  # each worker holds one: both workers answer
        pids = set(pool.map(lambda _: _predict(server, b"slow"), range(4)))
    assert len(pids) == 2
    _predict(server, b"x", version="1.0")
    text = _page(server)

    for pattern in TORCHSERVE_PATTERNS:
        assert len(re.findall(pattern, text)) == 1, f"pattern not found once: {pattern}"
    # Every label list ends with a comma, as TorchServe's Java client writes it.
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert all(",} " in line for line in samples if "{" in line)

    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert {name: families[name].type for name in (
        "Requests2XX", "ts_inference_requests", "QueueTime", "WorkerLoadTime", "GPUUtilization",
        "ReporterRequests", "ReporterBatchSize", "ReporterRatio", "batchserve_batch_size")} == {
        "Requests2XX": "counter", "ts_inference_requests": "counter", "QueueTime": "gauge",
        "WorkerLoadTime": "gauge", "GPUUtilization": "gauge", "ReporterRequests": "counter",
        "ReporterBatchSize": "gauge", "ReporterRatio": "histogram",
        "batchserve_batch_size": "histogram"}
    assert "# HELP ReporterTime Torchserve prometheus gauge metric with unit: Milliseconds\n" \
        in text
    # The version a request named, else "default".
    assert _series(text, "ts_inference_requests_total") == {
        (("model_name", MODEL), ("model_version", "default")): 4.0,
        (("model_name", MODEL), ("model_version", "1.0")): 1.0}
    # One series per metric and dimension values, whichever worker reported them.
    assert _series(text, "ReporterRequests_total") == {(): 5.0}
    assert _series(text, "ReporterLoads_total") == {
        (("ModelName", MODEL), ("Level", "Model")): 2.0}
    assert set(_series(text, "WorkerLoadTime")) == {
        (("WorkerName", f"W-{number}-{MODEL}_1.0"), ("Level", "Host"))
        for number in (9000, 9001)}
    ratio = _series(text, "ReporterRatio_bucket")
    assert ratio[(("ModelName", MODEL), ("Level", "Model"), ("le", "10.0"))] == 0.0
    assert ratio[(("ModelName", MODEL), ("Level", "Model"), ("le", "+Inf"))] == 5.0
    assert _series(text, "ReporterRatio_sum") == {
        (("ModelName", MODEL), ("Level", "Model")): 250.0}
    # No GPU here: the families are there, without samples.
    assert "# TYPE GPUMemoryUsed gauge\n" in text and "\nGPUMemoryUsed{" not in text
    # A metric line the handler printed is a line of the model log, not a metric: what a
    # handler prints may be a client's bytes (issue 31).
    assert "ReporterPrinted" not in text
    model_log = server.server.config.log_location / "model_log.log"
    server.wait_for(lambda: model_log.exists()
                    and "[METRICS]ReporterPrinted" in model_log.read_text(),
                    "the printed line in the model log")


def test_handler_metrics_survive_a_worker_restart(server: RunningServer) -> None:
    before = _page(server)
    requests_before = _series(before, "ReporterRequests_total")[()]
    workers = server.describe(MODEL)["workers"]
    victim = workers[0]["pid"]  # type: ignore[index]
    psutil.Process(victim).kill()

    def restarted() -> bool:
        now = server.describe(MODEL)["workers"]
        return all(w["status"] == "READY" for w in now) and victim not in {  # type: ignore[union-attr,index]
            w["pid"] for w in now}  # type: ignore[union-attr,index]

    server.wait_for(restarted, "the killed worker to be back", timeout_s=60)
    _predict(server, b"x")
    after = _page(server)
    # Kept by the frontend: nothing lost with the worker; its new life's initialize counted.
    assert _series(after, "ReporterRequests_total") == {(): requests_before + 1}
    assert _series(after, "ReporterLoads_total") == {
        (("ModelName", MODEL), ("Level", "Model")): 3.0}


def test_a_handler_cannot_grow_a_metric_without_bound(server: RunningServer,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="frontend.observe.families"):
        _predict(server, f"tags:{MAX_LABEL_SETS + 100}".encode())
        _predict(server, b"tags:1200")
    tagged = _series(_page(server), "ReporterTagged_total")
    assert len(tagged) == MAX_LABEL_SETS
    assert tagged[(("Tag", "t0"), ("ModelName", MODEL), ("Level", "Model"))] == 2.0
    warnings = [record for record in caplog.records if "ReporterTagged" in record.getMessage()]
    assert len(warnings) == 1, "the cap is logged once"


def test_the_name_filter_finds_torchserve_and_handler_families(server: RunningServer) -> None:
    text = _page(server, "?name[]=ReporterRatio_count&name[]=Requests2XX")
    assert sorted(family.name for family in text_string_to_metric_families(text)) == [
        "ReporterRatio", "Requests2XX"]


def test_log_mode_writes_torchserve_metric_logs(store: Path) -> None:
    logs = store.parent / "log-mode-logs"
    running = launch_server(store, f"{MODEL}={MODEL}.mar", metrics_config=METRICS_YAML,
                            metrics_mode="log", log_location=logs)
    try:
        _predict(running, b"x")
        page = _page(running)
    finally:
        running.stop()
    # TorchServe's families go to the logs; the page keeps only batchserve's own.
    names = {family.name for family in text_string_to_metric_families(page)}
    assert names and all(name.startswith("batchserve_") for name in names)
    ts_lines = (logs / "ts_metrics.log").read_text()
    model_lines = (logs / "model_metrics.log").read_text()
    stamp = r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d{3} - "
    assert re.search(stamp + r"Requests2XX\.Count:1\.0\|#Level:Host\|#hostname:[^,]+,"
                     r"timestamp:\d+$", ts_lines, re.MULTILINE), ts_lines
    assert re.search(stamp + r"ts_inference_requests_total\.Count:1\.0\|#model_name:reporter,"
                     r"model_version:default\|#hostname:[^,]+,timestamp:\d+$", ts_lines,
                     re.MULTILINE), ts_lines
    assert re.search(stamp + r"CPUUtilization\.Percent:[\d.]+\|#Level:Host\|", ts_lines,
                     re.MULTILINE), ts_lines
    assert re.search(stamp + r"ReporterLoads\.count:1\.0\|#ModelName:reporter,Level:Model"
                     r"\|#hostname:[^,]+,requestID:[0-9a-f-]{36},timestamp:\d+$", model_lines,
                     re.MULTILINE), model_lines
    # Not declared and auto-detection off: not written.
    assert "ReporterTime" not in model_lines
