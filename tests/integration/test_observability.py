"""Metrics, logs, and where workers run (GPUs simulated, CPU cores pinned)."""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from protos import inference_pb2, inference_pb2_grpc
from tests.conftest import RunningServer


def _samples(server: RunningServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = requests.get(f"{server.metrics}/metrics", timeout=10).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _value(samples: dict, name: str, **labels: str) -> float:
    matches = [value for (sample, sample_labels), value in samples.items()
               if sample == name and all(item in sample_labels for item in labels.items())]
    assert matches, f"no sample {name} {labels}"
    return sum(matches)


def _count(samples: dict, name: str, **labels: str) -> float:
    """A counter's value, 0 before its first sample (TorchServe's counters have none)."""
    return sum(value for (sample, sample_labels), value in samples.items()
               if sample == name and all(item in sample_labels for item in labels.items()))


def test_metrics_count_what_happened(build_mar, start_server) -> None:
    build_mar("metered", "metered")
    # The handler's metrics are not in TorchServe's default metrics.yaml: kept only so.
    server = start_server(model_metrics_auto_detect=True)
    requests.post(f"{server.management}/models",
                  params={"url": "metered.mar", "batch_size": 4, "max_batch_delay": 20,
                          "initial_workers": 1, "synchronous": "true"},
                  timeout=60).raise_for_status()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: server.predict("metered", b"x" * i), range(40)))
    assert all(a.status_code == 200 for a in answers)
    assert server.predict("nope", b"x").status_code == 404

    samples = _samples(server)
    model = {"model_name": "metered", "model_version": "1.0"}
    # TorchServe's label: the version a request named, "default" when it named none.
    unversioned = {"model_name": "metered", "model_version": "default"}
    # prometheus_client's parser names every counter's samples <family>_total.
    assert _value(samples, "ts_inference_requests_total", **unversioned) == 40
    assert _value(samples, "ts_inference_latency_microseconds_total", **unversioned) > 0
    assert _value(samples, "ts_queue_latency_microseconds_total", **unversioned) >= 0
    # As TorchServe counts them: every HTTP response, the registration's included.
    assert _value(samples, "Requests2XX_total") == 41
    assert _value(samples, "Requests4XX_total") == 1
    batching = server.describe("metered")["batching"]
    assert _value(samples, "batchserve_batch_size_count", **model) == batching["batchesTotal"]  # type: ignore[index]
    assert _value(samples, "batchserve_batch_size_sum", **model) == 40
    assert _value(samples, "batchserve_request_latency_seconds_count", **model) == 40
    assert _value(samples, "batchserve_queue_wait_seconds_count", **model) == 40
    assert _value(samples, "batchserve_handler_seconds_count", **model) == batching["batchesTotal"]  # type: ignore[index]
    assert _value(samples, "batchserve_queue_depth", **model) == 0
    assert _value(samples, "batchserve_workers", **model) == 1
    # A handler's metric: its own dimensions, those TorchServe adds, the host; no model labels.
    assert _value(samples, "ItemsSeen_total", shape="any", ModelName="metered",
                  Level="Model") == 40
    assert _value(samples, "LastBatchBytes", ModelName="metered", Level="Model") >= 0
    assert _value(samples, "CPUUtilization", Level="Host") >= 0
    assert _value(samples, "MemoryUsed", Level="Host") > 0


def test_refused_requests_are_counted(build_mar, start_server, tmp_path: Path) -> None:
    build_mar("gate", "gate")
    server = start_server("gate.mar", job_queue_size=1)
    gate = tmp_path / "open"
    with ThreadPoolExecutor(2) as pool:
        (held,) = server.hold_gate(pool, gate)
        expired = server.predict("gate", b"/x", headers={"X-Request-Timeout": "0.1"})
        assert expired.status_code == 504
        # The expired request is no longer pending (it waits in the queue only to be dropped),
        # so the request counted here is the one just sent.
        assert server.describe("gate")["jobQueueStatus"]["pendingRequests"] == 0  # type: ignore[index]
        queued = pool.submit(server.predict, "gate", str(gate).encode())
        server.wait_for(
            lambda: server.describe("gate")["jobQueueStatus"]["pendingRequests"] == 1,  # type: ignore[index]
            "a queued request")
        assert server.predict("gate", b"/y").status_code == 503
        gate.touch()
        assert held.result(timeout=30).status_code == 200
        assert queued.result(timeout=30).status_code == 200
    samples = _samples(server)
    assert _value(samples, "batchserve_refused_requests_total", reason="deadline") == 1
    assert _value(samples, "batchserve_refused_requests_total", reason="queue_full") == 1


def test_access_log_and_model_log(build_mar, start_server, model_store: Path) -> None:
    build_mar("echo", "echo")
    logs = model_store.parent / "logs"
    server = start_server("echo.mar")
    for i in range(5):
        server.predict("echo", f"{i}".encode())
    access = logs / "access_log.log"

    def lines() -> list[str]:
        return access.read_text().splitlines() if access.exists() else []

    server.wait_for(lambda: len(lines()) == 5, "five access-log lines")
    # TorchServe's line: time, client, request line, status, milliseconds; nothing more.
    assert all(re.fullmatch(r'\S+ - /127\.0\.0\.1:\d+ "POST /predictions/echo HTTP/1\.1" '
                            r"200 \d+", line) for line in lines()), lines()
    model_log = (logs / "model_log.log").read_text()
    assert re.search(r" \[INFO \] W-\d+-echo_1\.0-stdout MODEL_LOG - ", model_log), model_log


def test_the_extended_access_log_adds_batchserves_fields(build_mar, start_server,
                                                          model_store: Path) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar", access_log_extended=True)
    assert server.predict("echo", b"x").status_code == 200
    assert requests.get(f"{server.management}/models", timeout=30).status_code == 200
    access = model_store.parent / "logs" / "access_log.log"

    def lines() -> list[str]:
        return access.read_text().splitlines() if access.exists() else []

    server.wait_for(lambda: len(lines()) == 2, "two access-log lines")
    predicted, listed = lines()
    assert re.fullmatch(r'\S+ - /127\.0\.0\.1:\d+ "POST /predictions/echo HTTP/1\.1" 200 \d+ '
                        r"model=echo version=1\.0 queue_ms=[\d.]+ batch=1 form_ms=[\d.]+ "
                        r"worker_ms=[\d.]+ .* reason=\w+", predicted), predicted
    # A request that is no prediction has TorchServe's fields only.
    assert re.fullmatch(r'\S+ - /127\.0\.0\.1:\d+ "GET /models HTTP/1\.1" 200 \d+', listed), \
        listed


def test_access_log_can_be_turned_off(build_mar, start_server, model_store: Path) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar", enable_access_log=False)
    assert server.predict("echo", b"quiet").status_code == 200
    assert not (model_store.parent / "logs" / "access_log.log").exists()


def test_workers_round_robin_over_simulated_gpus(build_mar, start_server, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    probes = tmp_path / "probes"
    probes.mkdir()
    monkeypatch.setenv("BATCHSERVE_TEST_PROBE_DIR", str(probes))
    build_mar("probe", "gpu_probe")
    config_file = tmp_path / "model-config.yaml"
    config_file.write_text("deviceIds: [1, 2]\n")
    build_mar("pinned", "gpu_probe", config_file=config_file)
    server = start_server(visible_gpus=3)  # GPU placement without a GPU

    def register(url: str, workers: int) -> list[dict[str, object]]:
        requests.post(f"{server.management}/models",
                      params={"url": url, "initial_workers": workers, "synchronous": "true"},
                      timeout=120).raise_for_status()
        return server.describe(url.removesuffix(".mar"))["workers"]  # type: ignore[return-value]

    workers = register("probe.mar", 7)
    assert [w["gpuId"] for w in workers] == [0, 1, 2, 0, 1, 2, 0]
    for worker in workers:  # each handler saw the gpu_id its worker was given
        assert (probes / str(worker["pid"])).read_text() == repr(worker["gpuId"])
    pinned = register("pinned.mar", 4)
    assert sorted(w["gpuId"] for w in pinned) == [1, 1, 2, 2]


def test_without_gpus_workers_run_on_cpu(build_mar, start_server, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHSERVE_TEST_PROBE_DIR", str(tmp_path))
    build_mar("probe", "gpu_probe")
    server = start_server("probe.mar", visible_gpus=0)
    worker = server.describe("probe")["workers"][0]  # type: ignore[index]
    assert worker["gpu"] is False and "gpuId" not in worker
    assert server.predict("probe", b"x").text == "None"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPU cores")
def test_cpu_affinity_gives_workers_disjoint_cores(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar", cpu_affinity=True, default_workers_per_model=2)
    workers = server.describe("echo")["workers"]
    affinities = [set(psutil.Process(w["pid"]).cpu_affinity()) for w in workers]  # type: ignore[index]
    assert all(len(cores) == 1 for cores in affinities)
    assert affinities[0].isdisjoint(affinities[1])
    assert [set(w["cpus"]) for w in workers] == affinities  # type: ignore[index]


def test_metrics_can_be_filtered_by_name(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar")
    server.predict("echo", b"x")
    text = requests.get(f"{server.metrics}/metrics",
                        params=[("name[]", "ts_inference_requests_total"),
                                ("name[]", "Requests2XX")], timeout=10).text
    names = {family.name for family in text_string_to_metric_families(text)}
    assert names == {"ts_inference_requests", "Requests2XX"}  # the parser drops _total


def test_the_metrics_page_reads_as_torchserve_writes_it(build_mar, start_server) -> None:
    import grpc

    from protos import inference_pb2, inference_pb2_grpc

    build_mar("metered", "metered")
    server = start_server("metered.mar", model_metrics_auto_detect=True)
    assert server.predict("metered", b"x").status_code == 200
    assert requests.get(f"{server.inference}/ping", timeout=10).status_code == 200
    assert requests.get(f"{server.management}/models", timeout=10).status_code == 200
    assert requests.get(f"{server.inference}/nothing-here", timeout=10).status_code == 404
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_inference_port}") as channel:
        inference_pb2_grpc.InferenceAPIsServiceStub(channel).Predictions(
            inference_pb2.PredictionsRequest(model_name="metered", input={"body": b"y"}),
            timeout=30)
    assert requests.get(f"{server.metrics}/metrics", timeout=10).status_code == 200
    text = requests.get(f"{server.metrics}/metrics", timeout=10).text

    families = list(text_string_to_metric_families(text))
    names = [family.name for family in families]
    assert len(names) == len(set(names)), "a family appears twice"
    untyped = [family.name for family in families if family.type in ("unknown", "untyped")]
    assert untyped == [], f"families Prometheus cannot type: {untyped}"
    for name in ("ts_inference_requests_total", "ts_inference_latency_microseconds",
                 "ts_queue_latency_microseconds", "Requests2XX", "Requests4XX", "Requests5XX",
                 "ItemsSeen"):
        assert f"# HELP {name} " in text and f"# TYPE {name} counter\n" in text, name
        if name != "Requests5XX":  # nothing counted: no sample yet, as TorchServe
            assert f"\n{name}{{" in text, name  # the samples carry the same name
    assert "_total_total" not in text
    by_status = {family.name: sum(sample.value for sample in family.samples)
                 for family in families if family.name.startswith("Requests")}
    # 2XX: the HTTP and gRPC predictions, the ping, the list, the first scrape; 4XX: the 404.
    assert by_status == {"Requests2XX": 5, "Requests4XX": 1, "Requests5XX": 0}


def test_each_worker_gets_its_share_of_the_cores(build_mar, start_server, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHSERVE_TEST_PROBE_DIR", str(tmp_path))
    build_mar("probe", "env_probe")
    cores = len(os.sched_getaffinity(0))
    server = start_server("probe.mar", default_workers_per_model=2)
    requests.post(f"{server.management}/models", params={
        "url": "probe.mar", "model_name": "second", "initial_workers": 2, "synchronous": "true"},
        timeout=60).raise_for_status()
    for model, share in (("probe", max(1, cores // 2)), ("second", max(1, cores // 4))):
        for worker in server.describe(model)["workers"]:  # type: ignore[union-attr]
            assert worker["cpuThreads"] == share  # type: ignore[index]
            seen = json.loads((tmp_path / f"{worker['pid']}.json").read_text())  # type: ignore[index]
            assert seen == {"OMP_NUM_THREADS": str(share), "MKL_NUM_THREADS": str(share)}


def test_grpc_refusals_are_counted_with_their_own_status(build_mar, start_server) -> None:
    """A StreamPredictions (or Predictions) for no such model is a 404 in the access log and
    Requests4XX, not a 500."""
    import grpc

    from protos import inference_pb2, inference_pb2_grpc

    build_mar("echo", "echo")
    server = start_server("echo.mar")
    before = _samples(server)
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_inference_port}") as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        request = inference_pb2.PredictionsRequest(model_name="nope", input={"body": b"y"})
        with pytest.raises(grpc.RpcError) as streamed:
            list(stub.StreamPredictions(request, timeout=30))
        assert streamed.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as unary:
            stub.Predictions(request, timeout=30)
        assert unary.value.code() == grpc.StatusCode.NOT_FOUND
    after = _samples(server)
    # Plus one 2XX: the first scrape itself.
    assert _count(after, "Requests4XX_total") - _count(before, "Requests4XX_total") == 2
    assert _count(after, "Requests5XX_total") == _count(before, "Requests5XX_total")


#: What a client sends to forge a log line: CR/LF, then a line that looks like a log entry.
FORGED = "\r\n2024-01-01 00:00:00,000 [INFO] FORGED"


def test_no_client_byte_reaches_a_log_unescaped(build_mar, server_process) -> None:
    """Paths, versions, gRPC names, bodies a handler prints or logs: each log (access, model,
    server) keeps one line per entry and no raw control character."""
    build_mar("echo", "echo")
    build_mar("printer", "printer")
    server = server_process("echo.mar", "printer.mar")
    encoded = urllib.parse.quote(FORGED)
    for path in (f"/predictions/echo{encoded}", f"/predictions/echo/1.0{encoded}",
                 f"/explanations/echo{encoded}", "/predictions/echo%1b[2Jcleared",
                 f"/v1/models/echo{encoded}:predict", f"/v2/models/echo{encoded}/infer"):
        answer = requests.post(f"{server.inference}{path}", data=b"{}", timeout=30)
        assert answer.status_code == 404, (path, answer.text)
    registered = requests.post(f"{server.management}/models", timeout=60,
                               params={"url": f"nope{FORGED}.mar"})
    assert registered.status_code in (400, 404), registered.text
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_inference_port}") as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        with pytest.raises(grpc.RpcError) as missing:
            stub.Predictions(inference_pb2.PredictionsRequest(model_name=f"echo{FORGED}"),
                             timeout=30)
        assert missing.value.code() is grpc.StatusCode.NOT_FOUND
    printed = requests.post(f"{server.inference}/predictions/printer",
                            data=f"hello{FORGED}\x1b[2J".encode(), timeout=30)
    assert printed.status_code == 200

    logs = server.log.parent / "logs"
    access, model_log = logs / "access_log.log", logs / "model_log.log"
    server.wait_for(lambda: access.exists() and access.read_text().count("\n") >= 7,
                    "the access log's lines")
    server.wait_for(lambda: "logged: hello" in model_log.read_text(), "the handler's log line")
    stamp = re.compile(r"20\d\d-\d\d-\d\dT\d\d:\d\d:\d\d,\d{3} ")
    for path in (access, model_log, server.log):
        text = path.read_bytes().decode("utf-8")
        assert "\r" not in text and "\x1b" not in text, path.name
        for line in text.split("\n")[:-1]:
            # Each line is an entry of its own, stamped now (a forged one says 2024).
            assert not line.startswith("2024-01-01"), (path.name, line)
            assert stamp.match(line) or path == server.log, (path.name, line)
    # The access log writes the request line's target as sent (TorchServe's), percent-encoded;
    # a gRPC call by its method.
    assert f"/predictions/echo{encoded} HTTP/1.1\" 404 " in access.read_text()
    assert f"/predictions/echo/1.0{encoded} HTTP/1.1\" 404 " in access.read_text()
    assert "/predictions/echo%1B%5B2Jcleared HTTP/1.1\" 404 " in access.read_text()
    assert '"gRPC org.pytorch.serve.grpc.inference.InferenceAPIsService/Predictions HTTP/2.0" ' \
        "5 " in access.read_text()  # NOT_FOUND
    # The model log: a message the handler logs keeps to its line; a line it prints is a line
    # of that worker's output, escaped.
    lines = model_log.read_text().splitlines()
    assert any(line.endswith("logged: hello\\r\\n2024-01-01 00:00:00,000 [INFO] "
                             "FORGED\\x1b[2J") for line in lines)
    assert any("-stdout MODEL_LOG - 2024-01-01 00:00:00,000 [INFO] FORGED\\x1b[2J" in line
               for line in lines)
    # A line longer than the pipe reader's limit (64 KiB) is logged in pieces, and the worker
    # is still read from: its next answers and lines come.
    long_line = requests.post(f"{server.inference}/predictions/printer", data=b"y" * 300_000,
                              timeout=30)
    assert long_line.status_code == 200
    assert requests.post(f"{server.inference}/predictions/printer", data=b"after-long",
                         timeout=30).content == b"after-long"
    server.wait_for(lambda: "logged: after-long" in model_log.read_text(), "the next line")
