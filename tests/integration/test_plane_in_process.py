"""The inference plane of a real server, called in the server's own event loop with no
transport: real worker processes answer, batch and are counted exactly as for HTTP or gRPC
clients (tests/conftest.py ``async_server``)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop

from frontend.config import Address, parse_models_json
from frontend.errors import ModelNotFound, ModelVersionNotFound
from frontend.ops.management import describe_model
from frontend.ops.plane import Origin
from frontend.ops.services import Services
from frontend.server import Server
from protos import worker_pb2

ANSWER_TIMEOUT_S = 30.0
Serving = Callable[..., contextlib.AbstractAsyncContextManager[Server]]


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    uvloop.run(scenario())


def _origin() -> Origin:
    return Origin("in-process", "POST", "/predictions/echo", "HTTP/1.1", count_status=True)


async def _predict(services: Services, name: str, data: bytes, version: str | None = None
                   ) -> worker_pb2.Response:
    """One prediction through the plane, recorded as a transport records it."""
    async with services.plane.call(_origin()) as call:
        answer = await asyncio.wait_for(
            services.plane.predict(call, name, version, [], [("body", data, None)]),
            ANSWER_TIMEOUT_S)
        assert isinstance(answer, worker_pb2.Response)
        call.status = answer.status
    return answer


def _requests_total(services: Services, model: str) -> float:
    """The model's requests, whatever version they named (each is a series of its own)."""
    text = services.metrics.exposition().decode()
    matches = re.findall(rf'^ts_inference_requests_total\{{[^}}]*model_name="{model}"[^}}]*\}} '
                         r"(\S+)$", text, re.MULTILINE)
    assert matches, f"no ts_inference_requests_total for {model}"
    return sum(map(float, matches))


def _requests_2xx(services: Services) -> float:
    match = re.search(r"^Requests2XX\{[^}]*\} (\S+)$", services.metrics.exposition().decode(),
                      re.MULTILINE)
    assert match is not None
    return float(match[1])


def test_predict_in_process_reaches_a_real_worker_and_is_counted(
        build_mar: Callable[..., Path], async_server: Serving) -> None:
    build_mar("echo", "echo")

    async def scenario() -> None:
        async with async_server("echo.mar") as server:
            services = server.services
            answer = await _predict(services, "echo", b"\x00hello\xff")
            assert (answer.status, answer.body) == (200, b"\x00hello\xff")
            again = await _predict(services, "echo", b"two", version="1.0")
            assert again.body == b"two"
            assert again.request_id != answer.request_id

            assert _requests_total(services, "echo") == 2
            assert _requests_2xx(services) == 2
            model = services.registry.get("echo")
            described = describe_model(model, services.metrics.records)
            assert described["batching"]["requestsTotal"] == 2  # type: ignore[index]

            with pytest.raises(ModelNotFound):
                await _predict(services, "nope", b"x")
            with pytest.raises(ModelVersionNotFound):
                await _predict(services, "echo", b"x", version="9.0")
            assert _requests_total(services, "echo") == 2, "refusals are not echo's requests"

    run(scenario)


def test_concurrent_predictions_in_process_are_batched(
        build_mar: Callable[..., Path], async_server: Serving) -> None:
    build_mar("echo", "echo")
    # FIXED with a long delay: a batch leaves the queue only when it holds 4 requests.
    models = parse_models_json(
        '{"echo": {"1.0": {"batchSize": 4, "maxBatchDelay": 60000, "batchPolicy": "fixed"}}}')

    async def scenario() -> None:
        async with async_server("echo.mar", models=models) as server:
            services = server.services
            for round_ in range(2):
                inputs = [f"r{round_}-{i}".encode() for i in range(4)]
                answers = await asyncio.gather(*(_predict(services, "echo", data)
                                                 for data in inputs))
                assert [answer.body for answer in answers] == inputs

            batching = describe_model(services.registry.get("echo"),
                                      services.metrics.records)["batching"]
            assert batching["recentBatchSizes"] == [4, 4]  # type: ignore[index]
            assert batching["batchesTotal"] == 2  # type: ignore[index]
            assert batching["requestsTotal"] == 8  # type: ignore[index]
            assert _requests_total(services, "echo") == 8

    run(scenario)


def test_async_server_fails_clearly_when_the_server_cannot_start(async_server: Serving) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]

        async def scenario() -> None:
            with pytest.raises(AssertionError, match="ended before the server started") as failed:
                async with async_server(inference_address=Address("127.0.0.1", port)):
                    pytest.fail("the server cannot have started on a busy port")
            assert isinstance(failed.value.__cause__, OSError)

        run(scenario)
