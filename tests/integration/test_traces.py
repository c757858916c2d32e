"""OpenTelemetry traces (docs/batches.md, "Traces"): a real server exports its spans over
OTLP/HTTP to a real receiver started here (built on opentelemetry-proto: the OpenTelemetry
Collector's own binary cannot be installed from the package registries this project uses),
and the spans' structure is checked: a request span per request (a child of the caller's
``traceparent`` over HTTP, both the fast path and the ASGI routes, and over gRPC), its
``queue``, ``batch`` and ``worker`` children, the batch's own span linked from each request
of the batch, and their attributes. With tracing off, no OpenTelemetry module is imported."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from frontend.config import load_config
from frontend.errors import ConfigError
from frontend.settings import PolicyName
from protos import inference_pb2, inference_pb2_grpc
from tests.conftest import ROOT, RunningServer, launch_server

MODEL = "echo"
#: Callers' contexts: W3C traceparent (version, trace id, parent span id, flags: sampled).
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e47{:02x}"
CALLER_SPAN = "00f067aa0ba902{:02x}"
TRACESTATE = "vendor=opaque,other=1"


@dataclass
class Receiver:
    """An OTLP/HTTP receiver on a free loopback port: POST /v1/traces with an
    ExportTraceServiceRequest (protobuf, gzip or not), answered as the Collector answers."""

    server: ThreadingHTTPServer
    spans: list[tuple[dict[str, Any], trace_pb2.Span]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"


def _start_receiver() -> Receiver:
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces" or \
                    self.headers.get("content-type") != "application/x-protobuf":
                self.send_error(404 if self.path != "/v1/traces" else 415)
                return
            export = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            with receiver.lock:
                for resource_spans in export.resource_spans:
                    resource = _attributes(resource_spans.resource.attributes)
                    for scope_spans in resource_spans.scope_spans:
                        receiver.spans.extend((resource, span) for span in scope_spans.spans)
            answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    receiver = Receiver(ThreadingHTTPServer(("127.0.0.1", 0), Handler))
    threading.Thread(target=receiver.server.serve_forever, daemon=True).start()
    return receiver


def _attributes(pairs: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for pair in pairs:
        kind = pair.value.WhichOneof("value")
        values[pair.key] = getattr(pair.value, kind) if kind else None
    return values


def _traceparent(n: int) -> str:
    return f"00-{CALLER_TRACE.format(n)}-{CALLER_SPAN.format(n)}-01"


@dataclass
class Sent:
    """One request sent: how, and the caller context it carried (None: none)."""

    transport: str
    caller: int | None
    tracestate: bool = False


@dataclass
class Traced:
    receiver: Receiver
    sent: list[Sent]
    statuses: list[int]


def _http(server: RunningServer, route: str, sent: Sent) -> int:
    headers = {}
    if sent.caller is not None:
        headers["traceparent"] = _traceparent(sent.caller)
        if sent.tracestate:
            headers["tracestate"] = TRACESTATE
    response = requests.post(f"{server.inference}/{route}/{MODEL}", data=b"hi",
                             headers=headers, timeout=30)
    return response.status_code


def _grpc(server: RunningServer, sent: Sent) -> int:
    metadata = []
    if sent.caller is not None:
        metadata.append(("traceparent", _traceparent(sent.caller)))
        if sent.tracestate:
            metadata.append(("tracestate", TRACESTATE))
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_inference_port}") as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        answer = stub.Predictions(inference_pb2.PredictionsRequest(
            model_name=MODEL, input={"body": b"hi"}), metadata=metadata, timeout=30)
    return 200 if answer.prediction == b"hi" else 500


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    """One server traced to one receiver; two rounds of four concurrent requests (a batch of
    four each: fixed policy, batch_size 4, a long max_batch_delay), then the server is
    stopped, which exports every span left."""
    from model_archiver.packaging import ArchiveOptions, build_archive

    store = tmp_path_factory.mktemp("traces") / "model_store"
    store.mkdir()
    build_archive(ArchiveOptions(
        model_name=MODEL, version="1.0", handler=str(ROOT / "tests/fixtures/handlers/echo.py"),
        export_path=store, force=True))
    receiver = _start_receiver()
    server = launch_server(store, f"{MODEL}.mar", otel_traces=True,
                           otel_exporter_otlp_endpoint=receiver.url, default_batch_size=4,
                           default_max_batch_delay_ms=5000,
                           default_batch_policy=PolicyName.FIXED)
    rounds: list[list[tuple[Callable[[RunningServer, Sent], int], Sent]]] = [
        # The fast path and gRPC, with and without a caller.
        [(lambda s, x: _http(s, "predictions", x), Sent("fast", 1, tracestate=True)),
         (lambda s, x: _http(s, "predictions", x), Sent("fast", None)),
         (_grpc, Sent("grpc", 2, tracestate=True)),
         (_grpc, Sent("grpc", None))],
        # An ASGI route (/explanations).
        [(lambda s, x: _http(s, "explanations", x), Sent("asgi", 3)),
         (lambda s, x: _http(s, "explanations", x), Sent("asgi", None)),
         (lambda s, x: _http(s, "explanations", x), Sent("asgi", 4, tracestate=True)),
         (lambda s, x: _http(s, "explanations", x), Sent("asgi", None))],
    ]
    sent: list[Sent] = []
    statuses: list[int] = []
    try:
        with ThreadPoolExecutor(4) as pool:
            for requests_of_round in rounds:
                futures = [pool.submit(send, server, item) for send, item in requests_of_round]
                statuses += [future.result(timeout=60) for future in futures]
                sent += [item for _, item in requests_of_round]
    finally:
        server.stop()
    try:
        yield Traced(receiver, sent, statuses)
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()


def _by_kind(traced: Traced, kind: int) -> list[trace_pb2.Span]:
    return [span for _, span in traced.receiver.spans if span.kind == kind]


def _children(traced: Traced, parent: trace_pb2.Span) -> dict[str, trace_pb2.Span]:
    found = {}
    for _, span in traced.receiver.spans:
        if span.parent_span_id == parent.span_id and span.trace_id == parent.trace_id:
            assert span.name not in found, f"two {span.name} children"
            found[span.name] = span
    return found


def test_a_span_per_request_child_of_the_callers_context(traced: Traced) -> None:
    assert traced.statuses == [200] * len(traced.sent)
    requests_ = _by_kind(traced, trace_pb2.Span.SPAN_KIND_SERVER)
    assert len(requests_) == len(traced.sent)
    by_caller = {bytes(span.trace_id).hex(): span for span in requests_}
    fresh = [span for span in requests_ if not span.parent_span_id]
    for item in traced.sent:
        if item.caller is None:
            continue
        span = by_caller[CALLER_TRACE.format(item.caller)]  # the caller's trace id kept
        assert bytes(span.parent_span_id).hex() == CALLER_SPAN.format(item.caller)
        assert span.trace_state == (TRACESTATE if item.tracestate else "")
        if item.transport == "grpc":
            assert _attributes(span.attributes)["rpc.system"] == "grpc"
            assert span.name == f"gRPC /{MODEL}"
        else:
            route = "predictions" if item.transport == "fast" else "explanations"
            assert span.name == f"POST /{route}/{MODEL}"
            assert _attributes(span.attributes)["http.response.status_code"] == 200
    # Without a caller: a trace of its own each.
    assert len(fresh) == sum(1 for item in traced.sent if item.caller is None)
    assert len({bytes(span.trace_id) for span in fresh}) == len(fresh)
    for resource, _ in traced.receiver.spans:
        assert resource["service.name"] == "batchserve"


def test_queue_batch_and_worker_children_within_the_request(traced: Traced) -> None:
    slack_ns = 2_000_000  # two clocks read a moment apart
    for span in _by_kind(traced, trace_pb2.Span.SPAN_KIND_SERVER):
        children = _children(traced, span)
        assert set(children) == {"queue", "batch", "worker"}, span.name
        for child in children.values():
            assert child.kind == trace_pb2.Span.SPAN_KIND_INTERNAL
            assert span.start_time_unix_nano - slack_ns <= child.start_time_unix_nano \
                <= child.end_time_unix_nano <= span.end_time_unix_nano + slack_ns
        queue, batch, worker = children["queue"], children["batch"], children["worker"]
        assert abs(queue.end_time_unix_nano - batch.start_time_unix_nano) <= slack_ns
        assert batch.start_time_unix_nano - slack_ns <= worker.start_time_unix_nano
        assert worker.end_time_unix_nano == batch.end_time_unix_nano
        assert _attributes(worker.attributes)["batchserve.handler_time_ms"] > 0


def test_the_batch_is_a_span_linked_from_each_of_its_requests(traced: Traced) -> None:
    batches = {bytes(span.span_id): span for _, span in traced.receiver.spans
               if span.name == f"batch {MODEL}" and not span.parent_span_id}
    assert len(batches) == 2
    linked: dict[bytes, list[trace_pb2.Span]] = {key: [] for key in batches}
    for span in _by_kind(traced, trace_pb2.Span.SPAN_KIND_SERVER):
        assert len(span.links) == 1
        link = span.links[0]
        batch = batches[bytes(link.span_id)]
        assert link.trace_id == batch.trace_id
        linked[bytes(link.span_id)].append(span)
        # Its own batch child links to the same span.
        assert [bytes(x.span_id) for x in _children(traced, span)["batch"].links] == \
            [bytes(link.span_id)]
        request, batch_attributes = _attributes(span.attributes), _attributes(batch.attributes)
        assert request["batchserve.model.name"] == MODEL
        assert request["batchserve.model.version"] == "1.0"
        assert request["batchserve.batch.id"] == batch_attributes["batchserve.batch.id"]
        assert request["batchserve.batch.size"] == batch_attributes["batchserve.batch.size"]
    for key, batch in batches.items():
        attributes = _attributes(batch.attributes)
        assert attributes["batchserve.model.name"] == MODEL
        assert attributes["batchserve.batch.size"] == len(linked[key]) == 4
        assert attributes["batchserve.batch.requests"] == 4
        # A batch's requests come from traces of their own, not the batch's.
        assert all(span.trace_id != batch.trace_id for span in linked[key])


def test_otlp_over_grpc(tmp_path: Path, build_mar: Callable[..., Path],
                        model_store: Path) -> None:
    """``otel_exporter_otlp_protocol=grpc``: the spans reach an OTLP/gRPC receiver (the
    TraceService of opentelemetry-proto, served here)."""
    from concurrent import futures

    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    received: list[trace_pb2.Span] = []

    class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    received.extend(scope_spans.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    receiver = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), receiver)
    port = receiver.add_insecure_port("127.0.0.1:0")
    receiver.start()
    build_mar(MODEL, "echo")
    try:
        server = launch_server(model_store, f"{MODEL}.mar", otel_traces=True,
                               otel_exporter_otlp_protocol="grpc",
                               otel_exporter_otlp_endpoint=f"http://127.0.0.1:{port}")
        try:
            assert _http(server, "predictions", Sent("fast", 7)) == 200
        finally:
            server.stop()
    finally:
        receiver.stop(grace=None)
    [request] = [span for span in received if span.kind == trace_pb2.Span.SPAN_KIND_SERVER]
    assert bytes(request.trace_id).hex() == CALLER_TRACE.format(7)
    assert bytes(request.parent_span_id).hex() == CALLER_SPAN.format(7)
    assert {span.name for span in received} >= {"queue", "batch", "worker"}


def test_tracing_off_imports_no_opentelemetry(tmp_path: Path, build_mar: Callable[..., Path],
                                              model_store: Path) -> None:
    """A server (tracing off, no OTEL_* variables) answers HTTP and gRPC predictions with a
    traceparent, and no opentelemetry module is in its process."""
    build_mar(MODEL, "echo")
    script = """
import sys
from pathlib import Path
import grpc, requests
from protos import inference_pb2, inference_pb2_grpc
from tests.conftest import launch_server

server = launch_server(Path(sys.argv[1]), "echo.mar")
try:
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    answer = requests.post(server.inference + "/predictions/echo", data=b"hi",
                           headers={"traceparent": traceparent}, timeout=30)
    assert answer.status_code == 200, answer.text
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_inference_port}") as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        reply = stub.Predictions(inference_pb2.PredictionsRequest(
            model_name="echo", input={"body": b"hi"}), metadata=[("traceparent", traceparent)],
            timeout=30)
        assert reply.prediction == b"hi"
finally:
    server.stop()
print("opentelemetry modules:", sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", script, str(model_store)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "opentelemetry modules: []"


def test_tracing_keys_and_opentelemetrys_variables(tmp_path: Path) -> None:
    properties = tmp_path / "config.properties"
    properties.write_text("otel_traces=true\n")

    def config(environ: dict[str, str], file: Path | None = None, **keys: str) -> Any:
        return load_config(file, keys, environ)

    assert not config({}).otel_traces
    assert config({}, properties).otel_traces
    assert config({}, otel_traces="true").otel_traces
    assert config({"OTEL_TRACES_EXPORTER": "otlp"}).otel_traces
    assert not config({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}).otel_traces
    # OpenTelemetry's variables win over config.properties, the command line over both.
    assert not config({"OTEL_SDK_DISABLED": "true"}, properties).otel_traces
    assert not config({"OTEL_TRACES_EXPORTER": "none"}, properties).otel_traces
    assert config({"OTEL_TRACES_EXPORTER": "none"}, otel_traces="true").otel_traces
    assert config({}, otel_exporter_otlp_protocol="grpc").otel_exporter_otlp_protocol == "grpc"
    with pytest.raises(ConfigError, match="otel_exporter_otlp_protocol"):
        config({}, otel_exporter_otlp_protocol="http/json")
    with pytest.raises(ConfigError, match="otel_exporter_otlp_endpoint"):
        config({}, otel_exporter_otlp_endpoint="collector:4318")
