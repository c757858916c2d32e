"""Issue 31: an error message quotes at most a short, escaped excerpt of what the client sent,
on every route (REST management and inference, workflows, SageMaker, KServe, gRPC).

A hostile value is a few MB (or as long as the route lets it be) and starts with terminal
control characters: every refusal of it is a small answer that names the excerpt escaped
(``\\x1b``), says how long the value was, and leaves the server serving.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import grpc
import pytest
import requests

from model_archiver.packaging import ArchiveOptions, build_archive
from protos import inference_pb2, inference_pb2_grpc
from tests.conftest import HANDLERS, RunningServer, launch_server

#: Terminal control sequences first (a title change, red): the message must escape them.
PREFIX = "\x1b]0;pwned\x07\x1b[31m"
BIG = PREFIX + "A" * 2_000_000
#: As long as a request head lets a value be (the URL, a header line).
HEAD_SIZED = PREFIX + "A" * 4000
#: A header's value (httptools refuses control characters in one, so only its length).
HEADER = "A" * 4000
SMALL_ANSWER_BYTES = 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    store = tmp_path_factory.mktemp("quoted") / "model_store"
    store.mkdir()
    build_archive(ArchiveOptions(model_name="echo", handler=str(HANDLERS / "echo.py"),
                                 export_path=store))
    running = launch_server(store, "echo.mar")
    try:
        yield running
    finally:
        running.stop()


def _small_and_escaped(message: str, size: int, hostile: str) -> None:
    assert size < SMALL_ANSWER_BYTES, f"an answer of {size} bytes"
    assert "\x1b" not in message and "\x07" not in message, message
    if hostile.startswith(PREFIX):
        assert "\\x1b" in message, message  # the excerpt is there, escaped
    assert f"({len(hostile)} characters)" in message, message


def _refused(response: requests.Response, status: int, hostile: str) -> None:
    assert response.status_code == status, response.text[:300]
    body = response.json()  # TorchServe's {"code", "type", "message"}, or KServe's {"error"}
    _small_and_escaped(body.get("message", body.get("error")), len(response.content), hostile)


ROUTES: dict[str, tuple[int, Callable[[RunningServer], requests.Response], str]] = {
    "register a setting (JSON)": (400, lambda s: requests.post(
        f"{s.management}/models", json={"url": "echo.mar", "batch_size": BIG}, timeout=60),
        BIG),
    "register a url (JSON)": (400, lambda s: requests.post(
        f"{s.management}/models", json={"url": BIG}, timeout=60), BIG),
    "register a workflow url (JSON)": (404, lambda s: requests.post(
        f"{s.management}/workflows", json={"url": BIG}, timeout=60), BIG),
    "scale parameter (query)": (400, lambda s: requests.put(
        f"{s.management}/models/echo", params={"min_worker": HEAD_SIZED}, timeout=60),
        HEAD_SIZED),
    "X-Request-Timeout": (400, lambda s: requests.post(
        f"{s.inference}/predictions/echo", data=b"x",
        headers={"X-Request-Timeout": HEADER}, timeout=60), HEADER),
    "SageMaker model_name": (404, lambda s: requests.post(
        f"{s.inference}/invocations", params={"model_name": HEAD_SIZED}, data=b"x",
        timeout=60), HEAD_SIZED),
    "KServe v2 header length": (400, lambda s: requests.post(
        f"{s.inference}/v2/models/echo/infer", data=b"{}",
        headers={"Inference-Header-Content-Length": HEADER,
                 "Content-Type": "application/octet-stream"}, timeout=60), HEADER),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_refusal_quotes_a_short_escaped_excerpt(server: RunningServer, route: str) -> None:
    status, send, hostile = ROUTES[route]
    _refused(send(server), status, hostile)
    assert server.predict("echo", b"still serving").content == b"still serving"


def test_grpc_quotes_a_short_escaped_excerpt(server: RunningServer) -> None:
    hostile = PREFIX + "A" * 1_000_000
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_inference_port}")
    stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)  # type: ignore[no-untyped-call]
    with pytest.raises(grpc.RpcError) as refused:
        stub.Predictions(inference_pb2.PredictionsRequest(
            model_name=hostile, input={"body": b"x"}), timeout=30)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    details = str(refused.value.details())
    _small_and_escaped(details, len(details.encode()), hostile)
    assert json.loads(requests.get(f"{server.inference}/ping", timeout=10).text) == {
        "status": "Healthy"}

