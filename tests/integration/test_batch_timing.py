"""Where a request's time went and why its batch left, against the real server: a real worker
running the ``phased`` fixture handler (BaseHandler-style steps that sleep known amounts),
real HTTP and gRPC clients. One server (``server_timing=request``) serves every case:

* the Server-Timing header only for a request that asks, its phases matching the handler's
  sleeps and the policy's wait, its parts adding up to no more than its total;
* on the fast path, the ASGI route (a pipelined request) and KServe v1; gRPC's trailing
  metadata, the same way;
* the reasons: a lone request to a fixed policy waits out max_batch_delay, four at once fill
  a batch, a client deadline sends one early, the adaptive policy sends a lone one at once;
* the access log's phase fields, the metrics page's families, describe's recent reasons
  and fill.
"""

from __future__ import annotations

import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from protos import inference_pb2, inference_pb2_grpc
from tests.conftest import RunningServer

ASK = {"X-Server-Timing": "true"}
#: The fixture handler's sleeps, in ms (tests/fixtures/handlers/phased.py).
PREPROCESS_MS, INFERENCE_MS, POSTPROCESS_MS = 20.0, 60.0, 30.0
MAX_DELAY_MS = 1000
#: Slack for a loaded machine: a sleep lasts at least its time, and seldom this much more.
SLACK_MS = 150.0
_PART = re.compile(r'^(\w+);dur=([0-9.]+)(?:;desc="(\w+)")?$')


def parse_server_timing(value: str) -> dict[str, tuple[float, str | None]]:
    parts = {}
    for part in value.split(", "):
        match = _PART.match(part)
        assert match, f"not a Server-Timing metric: {part!r}"
        parts[match[1]] = (float(match[2]), match[3])
    return parts


def register(server: RunningServer, name: str, policy: str) -> None:
    response = requests.post(
        f"{server.management}/models",
        params={"url": "phased.mar", "model_name": name, "batch_size": "4",
                "max_batch_delay": str(MAX_DELAY_MS), "batch_policy": policy,
                "initial_workers": "1", "synchronous": "true"}, timeout=60)
    assert response.status_code == 200, response.text


def samples(server: RunningServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = requests.get(f"{server.metrics}/metrics", timeout=10).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
          **labels: str) -> float:
    matches = [v for (sample, sample_labels), v in found.items()
               if sample == name and all(item in sample_labels for item in labels.items())]
    assert matches, f"no sample {name} {labels}"
    return sum(matches)


def pipelined(server: RunningServer, bodies: list[bytes]) -> list[bytes]:
    """Send ``bodies`` to the adaptive model on one connection without waiting between them
    (the last closes it); each response's head, as read until the server closed."""
    host, port = server.inference.removeprefix("http://").split(":")
    requests_bytes = b"".join(
        b"POST /predictions/adaptive HTTP/1.1\r\nHost: x\r\nX-Server-Timing: true\r\n"
        b"Content-Length: %d\r\n%s\r\n%s" % (
            len(body), b"Connection: close\r\n" if i == len(bodies) - 1 else b"", body)
        for i, body in enumerate(bodies))
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(requests_bytes)
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
    return [part for part in received.split(b"HTTP/1.1 200 OK")[1:]]


def check_steps(parts: dict[str, tuple[float, str | None]]) -> None:
    for phase, slept in (("preprocess", PREPROCESS_MS), ("inference", INFERENCE_MS),
                         ("postprocess", POSTPROCESS_MS)):
        assert slept <= parts[phase][0] < slept + SLACK_MS, (phase, parts)


def adds_up(parts: dict[str, tuple[float, str | None]], elapsed_ms: float) -> None:
    parts = dict(parts)
    total = parts.pop("total")[0]
    assert sum(ms for ms, _ in parts.values()) <= total + 0.01 * len(parts), parts
    assert total <= elapsed_ms


def test_phases_reasons_and_server_timing(build_mar, start_server, model_store: Path) -> None:
    build_mar("phased", "phased")
    server = start_server(server_timing="request", access_log_extended=True)
    register(server, "fixed", "fixed")
    register(server, "adaptive", "adaptive")

    # A lone request to the fixed policy waits out max_batch_delay, and asked for the header.
    started = time.monotonic()
    lone = server.predict("fixed", b"lone", headers=ASK)
    elapsed_ms = (time.monotonic() - started) * 1000
    assert lone.status_code == 200 and lone.content == b"lone"
    parts = parse_server_timing(lone.headers["Server-Timing"])
    assert list(parts) == ["queue", "batch_form", "worker", "preprocess", "inference",
                           "postprocess", "frontend", "total"]
    form_ms, reason = parts["batch_form"]
    assert reason == "max_delay" and MAX_DELAY_MS - 1 <= form_ms < MAX_DELAY_MS + SLACK_MS
    assert parts["queue"][0] < SLACK_MS  # the worker was free: it waited for company instead
    check_steps(parts)
    adds_up(parts, elapsed_ms)

    # Not asked: no header (the adaptive policy sends a lone request at once).
    quick = server.predict("adaptive", b"quick")
    assert quick.status_code == 200 and "Server-Timing" not in quick.headers

    # A request pipelined behind another goes the ASGI way: it is told too.
    answers = pipelined(server, [b"p1", b"p2"])
    assert len(answers) == 2 and all(b"\r\nserver-timing: queue;dur=" in a for a in answers)
    # So is a KServe v1 prediction.
    v1 = requests.post(f"{server.inference}/v1/models/adaptive:predict", headers=ASK,
                       json={"instances": ["i1", "i2"]}, timeout=30)
    assert v1.status_code == 200 and v1.json()["predictions"] == ["i1", "i2"]
    check_steps(parse_server_timing(v1.headers["Server-Timing"]))

    # Four at once fill a batch: each is told so.
    with ThreadPoolExecutor(4) as pool:
        four = list(pool.map(lambda i: server.predict("fixed", b"%d" % i, headers=ASK),
                             range(4)))
    assert [r.status_code for r in four] == [200] * 4
    for response in four:
        parts = parse_server_timing(response.headers["Server-Timing"])
        assert parts["batch_form"][1] == "full"
        assert parts["batch_form"][0] < MAX_DELAY_MS / 2
        check_steps(parts)

    # A client deadline shorter than the wait sends its batch early enough to answer it.
    started = time.monotonic()
    rushed = server.predict("fixed", b"rushed", headers={**ASK, "X-Request-Timeout": "0.8"})
    assert rushed.status_code == 200, rushed.text
    assert time.monotonic() - started < 0.8 + SLACK_MS / 1000
    assert parse_server_timing(rushed.headers["Server-Timing"])["batch_form"][1] == "deadline"

    # gRPC: the same opt-in, in the trailing metadata.
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_inference_port}") as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        request = inference_pb2.PredictionsRequest(model_name="adaptive", input={"data": b"g"})
        answer, rpc = stub.Predictions.with_call(request, metadata=(("x-server-timing", "1"),),
                                                 timeout=30)
        assert answer.prediction == b"g"
        trailing = dict(rpc.trailing_metadata() or ())
        grpc_parts = parse_server_timing(trailing["server-timing"])
        assert grpc_parts["batch_form"][1] == "adaptive"
        check_steps(grpc_parts)
        _, plain = stub.Predictions.with_call(request, timeout=30)
        assert "server-timing" not in dict(plain.trailing_metadata() or ())

    # describe: why the recent batches left, and how full they were.
    batching = server.describe("fixed")["batching"]
    assert batching["dispatchReasons"] == {"max_delay": 1, "full": 1, "deadline": 1}  # type: ignore[index]
    assert batching["batchFill"] == {  # type: ignore[index]
        "batches": 3, "mean": 0.5,
        "buckets": {"0.125": 0, "0.25": 2, "0.5": 0, "0.75": 0, "1": 1}}
    assert server.describe("adaptive")["batching"]["dispatchReasons"] == {"adaptive": 6}  # type: ignore[index]

    # The metrics page: reasons, fill, and each request's phases.
    found = samples(server)
    for reason, count in (("max_delay", 1), ("full", 1), ("deadline", 1), ("adaptive", 0),
                          ("slot_free", 0), ("sequence", 0)):
        assert value(found, "batchserve_dispatch_total", model_name="fixed", reason=reason) == count
    assert value(found, "batchserve_batch_fill_count", model_name="fixed") == 3
    assert value(found, "batchserve_batch_fill_bucket", model_name="fixed", le="0.25") == 2
    assert value(found, "batchserve_batch_fill_sum", model_name="fixed") == pytest.approx(1.5)
    for phase in ("queue", "batch_form", "worker", "preprocess", "inference", "postprocess",
                  "frontend"):
        assert value(found, "batchserve_request_phase_seconds_count", model_name="fixed",
                     phase=phase) == 6, phase
    assert value(found, "batchserve_request_phase_seconds_sum", model_name="fixed",
                 phase="inference") >= 6 * INFERENCE_MS / 1000
    assert value(found, "batchserve_request_phase_seconds_sum", model_name="fixed",
                 phase="batch_form") >= MAX_DELAY_MS / 1000 - 0.001

    # The extended access log: every line ends with the phases and the batch's reason.
    access = model_store.parent / "logs" / "access_log.log"

    def lines() -> list[str]:
        return access.read_text().splitlines() if access.exists() else []

    server.wait_for(lambda: sum("model=fixed" in line for line in lines()) == 6,
                    "the access log's lines")
    fields = re.compile(r" batch=1 form_ms=([0-9.]+) worker_ms=[0-9.]+ preprocess_ms=([0-9.]+) "
                        r"inference_ms=[0-9.]+ postprocess_ms=[0-9.]+ frontend_ms=[0-9.]+ "
                        r"reason=max_delay$")
    [match] = [m for line in lines() if (m := fields.search(line))]
    assert float(match[1]) >= MAX_DELAY_MS - 1
    assert PREPROCESS_MS <= float(match[2]) < PREPROCESS_MS + SLACK_MS
    assert sum(line.endswith(" reason=full") and " batch=4 " in line for line in lines()) == 4


def test_phases_and_reasons_off_keep_nothing_and_server_timing_still_answers(
        build_mar, start_server, model_store: Path) -> None:
    # request_phases=false and dispatch_stats=false: the extended access log's lines end at
    # batch=, the phase, reason and fill families have no samples, describe shows no
    # reasons; the Server-Timing header (its own switch) still splits the request.
    build_mar("phased", "phased")
    server = start_server(server_timing="request", request_phases=False,
                          dispatch_stats=False, access_log_extended=True)
    register(server, "fixed", "fixed")
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: server.predict("fixed", b"x%d" % i, headers=ASK),
                                range(4)))
    for answer in answers:
        assert answer.status_code == 200, answer.text
        parts = parse_server_timing(answer.headers["Server-Timing"])
        check_steps(parts)
        assert parts["batch_form"][1] in ("full", "max_delay")
    access = model_store.parent / "logs" / "access_log.log"
    server.wait_for(lambda: access.exists() and access.read_text().count("model=fixed") >= 4,
                    "the access log's lines")
    lines = [line for line in access.read_text().splitlines() if "model=fixed" in line]
    assert all(re.search(r" queue_ms=[0-9.]+ batch=\d+$", line) for line in lines), lines
    found = samples(server)
    for family in ("batchserve_request_phase_seconds", "batchserve_dispatch_total",
                   "batchserve_batch_fill"):
        assert not [name for name, _ in found if name.startswith(family)], family
    assert value(found, "batchserve_batch_size_count", model_name="fixed") >= 1
    batching = server.describe("fixed")["batching"]
    assert batching["dispatchReasons"] == {}  # type: ignore[index]
    assert batching["batchFill"]["batches"] == 0  # type: ignore[index]
