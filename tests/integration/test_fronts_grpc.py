"""The gRPC inference port through the front processes (``number_of_netty_threads`` > 1,
frontend/front/relay.py) against the real server: the server and one front accept on it
(SO_REUSEPORT), the front relays each call to the server's inner gRPC socket. The kernel spreads
fresh connections between them, so each test opens many fresh channels and counts, from the
outside, the calls the front relayed (``batchserve_front_grpc_requests_total``)."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import requests
from google.protobuf import empty_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from frontend.api.grpc.common import FRONT_PEER
from protos import inference_pb2, inference_pb2_grpc, open_inference_pb2, open_inference_pb2_grpc
from tests.certificates import make_certificates
from tests.conftest import RunningServer
from tests.integration import test_fronts as fronts

T = TypeVar("T")
MODELS = {"echo": "echo", "streamer": "streamer", "sleepy": "sleep"}
PREDICTIONS = "org.pytorch.serve.grpc.inference.InferenceAPIsService/Predictions"
#: A channel's own connection: grpc shares one among a process's channels to one target
#: otherwise, and a "fresh" channel would reach the process an open one reached.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


class Served(fronts.Served):
    """The module's server, and its clients' gRPC side."""

    def __init__(self, server: RunningServer, keys: dict[str, str], store: Path) -> None:
        super().__init__(server, keys, store)
        self.key = (("authorization", f"Bearer {keys['inference']}"),)
        assert server.grpc_inference_port is not None
        self.target = f"127.0.0.1:{server.grpc_inference_port}"

    def on_fresh_channel(self, call: Callable[[inference_pb2_grpc.InferenceAPIsServiceStub], T]
                         ) -> T:
        """``call`` on a channel of its own (a new connection: either process may take it)."""
        with grpc.insecure_channel(self.target, OWN_CONNECTION) as channel:
            return call(inference_pb2_grpc.InferenceAPIsServiceStub(channel))

    def predict(self, model: str, body: bytes, **kwargs: Any) -> Any:
        return self.on_fresh_channel(lambda stub: stub.Predictions(
            inference_pb2.PredictionsRequest(model_name=model, input={"body": body}),
            metadata=kwargs.pop("metadata", self.key), timeout=kwargs.pop("timeout", 30),
            **kwargs))

    def relayed(self) -> float:
        return self.metric("batchserve_front_grpc_requests_total")

    def predictions_logged(self, before: int, count: int) -> list[str]:
        """The access log's Predictions lines after its first ``before``, once ``count``."""
        def lines() -> list[str]:
            return [line for line in self.access_lines()[before:] if f"{PREDICTIONS} " in line]

        self.server.wait_for(lambda: len(lines()) >= count, "the access log lines")
        return lines()

    def described(self, model: str) -> dict[str, Any]:
        answer = requests.get(f"{self.server.management}/models/{model}",
                              headers=self.management_key, timeout=30)
        assert answer.status_code == 200, answer.text
        described: dict[str, Any] = answer.json()[0]
        return described


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    server, keys, store = fronts.launch_fronts(tmp_path_factory.mktemp("fronts_grpc"), MODELS,
                                               server_timing="request")
    try:
        yield Served(server, keys, store)
    finally:
        server.stop()


def _many(served: Served, count: int, call: Callable[[int], T]) -> list[T]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(call, range(count)))


def _code(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    error: Any = raised.value
    code: grpc.StatusCode = error.code()
    return code


def test_fresh_channels_reach_both_processes_and_each_call_is_counted_once(
        served: Served) -> None:
    before_total = served.metric("ts_inference_requests_total")
    before_relayed, before_lines = served.relayed(), len(served.access_lines())
    answers = _many(served, 40, lambda i: served.on_fresh_channel(
        lambda stub: stub.Predictions.with_call(
            inference_pb2.PredictionsRequest(model_name="echo", input={"body": b"%d" % i}),
            metadata=(*served.key, ("x-server-timing", "true")), timeout=30)))
    assert sorted(answer.prediction for answer, _ in answers) == sorted(
        b"%d" % i for i in range(40))
    # The server's trailing metadata comes back through the front unchanged.
    assert all(re.search(r"(^|, )total;dur=[\d.]+$",
                         dict(call.trailing_metadata()).get("server-timing", ""))
               for _, call in answers), [call.trailing_metadata() for _, call in answers][:3]
    relayed = served.relayed() - before_relayed
    assert 0 < relayed < 40, "both processes took connections"
    assert served.metric("ts_inference_requests_total") - before_total == 40
    lines = served.predictions_logged(before_lines, 40)
    # One line a call (its status gRPC's, OK), each naming the real client, never the front.
    assert len(lines) == 40
    assert all(re.search(rf' - /127\.0\.0\.1:\d+ "gRPC {PREDICTIONS} HTTP/2\.0" 0 ', line)
               for line in lines), "\n".join(lines)


def test_streamed_calls_through_a_front(served: Served) -> None:
    before = served.relayed()

    def stream(i: int) -> list[bytes]:
        return served.on_fresh_channel(lambda stub: [answer.prediction for answer in
                                                     stub.StreamPredictions(
            inference_pb2.PredictionsRequest(model_name="streamer", input={"body": b"s"}),
            metadata=served.key, timeout=30)])

    def both_ways(i: int) -> list[bytes]:
        requests_ = [inference_pb2.PredictionsRequest(model_name="echo",
                                                      input={"body": b"%d-%d" % (i, n)})
                     for n in range(5)]
        return served.on_fresh_channel(lambda stub: [answer.prediction for answer in
                                                     stub.StreamPredictions2(
            iter(requests_), metadata=served.key, timeout=30)])

    assert _many(served, 12, stream) == [[b"s part 1\n", b"s part 2\n", b"s part 3\n"]] * 12
    assert _many(served, 12, both_ways) == [[b"%d-%d" % (i, n) for n in range(5)]
                                            for i in range(12)]
    assert served.relayed() > before


def test_deadlines_errors_and_tokens_through_a_front(served: Served) -> None:
    before = served.relayed()
    late = _many(served, 12, lambda i: _code(lambda: served.predict("sleepy", b"2",
                                                                    timeout=0.3)))
    assert late == [grpc.StatusCode.DEADLINE_EXCEEDED] * 12

    def missing(i: int) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as raised:
            served.predict("nope", b"x")
        error: Any = raised.value
        return error.code(), error.details()

    answers = _many(served, 20, missing)
    # Each answered as the server answers it: its status and its message, unchanged.
    assert {code for code, _ in answers} == {grpc.StatusCode.NOT_FOUND}
    assert len({details for _, details in answers}) == 1 and "nope" in answers[0][1]
    refused = _many(served, 20, lambda i: _code(lambda: served.predict(
        "echo", b"x", metadata=(("authorization", "Bearer wrong"),))))
    assert refused == [grpc.StatusCode.UNAUTHENTICATED] * 20
    assert served.relayed() - before >= 3, "the front relayed some of each"
    assert {answer.prediction for answer in _many(
        served, 20, lambda i: served.predict("echo", b"ok"))} == {b"ok"}


def test_a_client_cancel_through_a_front_drops_its_queued_requests(served: Served) -> None:
    def idle() -> bool:
        described = served.described("sleepy")
        return described["jobQueueStatus"]["pendingRequests"] == 0 \
            and described["batching"]["inFlightBatches"] == 0

    for _ in range(20):  # until a channel lands on the front
        served.server.wait_for(idle, "the model idle")
        before_total = int(served.described("sleepy")["batching"]["requestsTotal"])
        before = served.relayed()
        with grpc.insecure_channel(served.target, OWN_CONNECTION) as channel:
            call = inference_pb2_grpc.InferenceAPIsServiceStub(channel).StreamPredictions2(
                iter([inference_pb2.PredictionsRequest(model_name="sleepy",
                                                       input={"body": b"0.3"})] * 20),
                metadata=served.key)
            assert next(call).prediction == b"0.3"
            call.cancel()
        served.server.wait_for(idle, "the cancelled requests to leave the queue")
        if served.relayed() > before:
            # One worker, 0.3 s a request: the cancelled stream's queued requests never ran.
            ran = int(served.described("sleepy")["batching"]["requestsTotal"]) - before_total
            assert ran < 20
            return
    raise AssertionError("20 fresh channels never reached the front")


def test_health_reflection_and_ping_through_a_front(served: Served) -> None:
    before = served.relayed()

    def probe(i: int) -> tuple[int, list[str], str]:
        with grpc.insecure_channel(served.target, OWN_CONNECTION) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=30)
            listed = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30)
            services = [service.name for answer in listed
                        for service in answer.list_services_response.service]
            ping = inference_pb2_grpc.InferenceAPIsServiceStub(channel).Ping(
                empty_pb2.Empty(), timeout=30)
            return health.status, services, ping.health

    for status, services, ping in _many(served, 16, probe):
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert "org.pytorch.serve.grpc.inference.InferenceAPIsService" in services
        assert json.loads(ping) == {"status": "Healthy"}
    assert served.relayed() > before  # (Ping is counted; health and reflection are not)


def test_a_client_cannot_name_its_own_peer(served: Served) -> None:
    before_lines = len(served.access_lines())
    spoofed = (*served.key, (FRONT_PEER, "7 ipv4:10.9.9.9:1"))
    answers = _many(served, 20, lambda i: served.predict("echo", b"x", metadata=spoofed))
    assert {answer.prediction for answer in answers} == {b"x"}
    text = requests.get(f"{served.server.metrics}/metrics", timeout=30).text
    assert 'batchserve_front_grpc_requests_total{front="7"}' not in text
    lines = served.predictions_logged(before_lines, 20)
    assert len(lines) == 20 and not any("10.9.9.9" in line for line in lines), "\n".join(lines)


def test_tls_through_a_front(tmp_path: Path, build_mar, start_server) -> None:
    certs = make_certificates(tmp_path / "certs")
    build_mar("echo", "echo")
    server = start_server("echo.mar", frontend_processes_exact=2, certificate_file=certs.cert,
                          private_key_file=certs.key, enable_grpc_ssl=True)
    credentials = grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes())

    def relayed() -> int:
        text = requests.get(f"{server.metrics}/metrics", timeout=30).text
        return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                   if line.startswith("batchserve_front_grpc_requests_total"))

    def predict(i: int) -> bytes:
        with grpc.secure_channel(f"localhost:{server.grpc_inference_port}",
                                 credentials, OWN_CONNECTION) as channel:
            answer = inference_pb2_grpc.InferenceAPIsServiceStub(channel).Predictions(
                inference_pb2.PredictionsRequest(model_name="echo",
                                                 input={"body": b"%d" % i}), timeout=30)
            prediction: bytes = answer.prediction
            return prediction

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(predict, range(24))) == [b"%d" % i for i in range(24)]
    assert relayed() > 0


def test_kserves_own_grpc_port_through_a_front(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar", frontend_processes_exact=2, kserve_protocol="v2",
                          kserve_rest_port=0, kserve_grpc_port=0)
    bound = server.server.bound
    assert bound is not None and bound.kserve_grpc_port != server.grpc_inference_port

    def ask(i: int) -> tuple[bool, bool]:
        with grpc.insecure_channel(f"127.0.0.1:{bound.kserve_grpc_port}",
                                   OWN_CONNECTION) as channel:
            stub = open_inference_pb2_grpc.GRPCInferenceServiceStub(channel)
            live = stub.ServerLive(open_inference_pb2.ServerLiveRequest(), timeout=30).live
            ready = stub.ModelReady(open_inference_pb2.ModelReadyRequest(name="echo"),
                                    timeout=30).ready
            return live, ready

    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(ask, range(24))) == {(True, True)}
    services = server.server.services
    assert services is not None and sum(services.metrics.front_grpc_requests().values()) > 0


def test_one_process_shares_no_grpc_port(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar", number_of_netty_threads=1)
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    with other, pytest.raises(OSError):
        other.bind(("127.0.0.1", server.grpc_inference_port))  # so_reuseport 0
    services = server.server.services
    assert services is not None
    assert not list(services.loader.run_dir.glob("grpc-*.sock"))
