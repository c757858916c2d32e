"""The HTTP apps (frontend/api/http/) called as ASGI apps: a scope, receive and send, no
socket. Built on a server's real services; the models registered here have no worker, so
nothing is predicted (the integration tests do that over real connections).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontend import __version__
from frontend.api.http import common
from frontend.api.http.app import CombinedApp, CountedResponses
from frontend.api.http.inference import InferenceApp
from frontend.api.http.management import ManagementApp
from frontend.api.http.metrics import MetricsApp
from frontend.models.loader import RegisterRequest
from frontend.observe.metrics import LEGACY
from frontend.ops.services import Services
from tests.unit.services import Reply, call, run_with_services, scope

NOT_FOUND = {"code": 404, "type": "ResourceNotFoundException",
             "message": "Requested resource is not found, please refer to API document."}
NOT_ALLOWED = {"code": 405, "type": "MethodNotAllowedException",
               "message": "Requested method is not allowed, please refer to API document."}
LEGACY_HELP = b"# HELP ts_inference_requests_total Torchserve prometheus counter metric with " \
    b"unit: Count\n"


def _families(page: bytes) -> list[str]:
    """The metric families of a Prometheus page, by the names its TYPE lines give them
    (prometheus_client's parser renames counters: it drops or adds ``_total``)."""
    return [line.split()[2] for line in page.decode().splitlines()
            if line.startswith("# TYPE ")]


def _with_apps(tmp_path: Path, model_store: Path | None,
               test: Callable[[Services], Awaitable[None]], **overrides: object) -> None:
    run_with_services(tmp_path, model_store, test, **overrides)


async def _echo_without_workers(services: Services) -> None:
    """Register echo.mar (built by the test) with no worker."""
    await services.loader.register(RegisterRequest(url="echo.mar", settings={"min_workers": 0}))


def _combined(services: Services) -> CombinedApp:
    return CombinedApp([InferenceApp(services), ManagementApp(services), MetricsApp(services)])


# ---- CombinedApp -----------------------------------------------------------------------------


def test_combined_app_tries_each_api_in_turn(tmp_path: Path) -> None:
    async def test(services: Services) -> None:
        app = _combined(services)
        ping = await call(app, "GET", "/ping")
        assert (ping.status, ping.json()) == (200, {"status": "Healthy"})
        models = await call(app, "GET", "/models")  # the inference app raised RouteNotFound
        assert (models.status, models.json()) == (200, {"models": []})
        metrics = await call(app, "GET", "/metrics")  # ... and so did the management app
        assert metrics.status == 200 and LEGACY_HELP in metrics.body

    _with_apps(tmp_path, None, test)


def test_combined_app_answers_torchserve_404_when_no_api_serves(tmp_path: Path) -> None:
    async def test(services: Services) -> None:
        for path in ("/", "/nowhere", "/models/a/b/c/d", "/metricsx"):
            answer = await call(_combined(services), "GET", path)
            assert (answer.status, answer.json()) == (404, NOT_FOUND), path
            assert answer.headers[b"content-type"] == b"application/json"

    _with_apps(tmp_path, None, test)


def test_combined_app_stops_at_the_first_api_that_refuses(tmp_path: Path) -> None:
    async def test(services: Services) -> None:
        # The metrics app owns /metrics: its 405 is the answer, not the next app's 404.
        refused = await call(CombinedApp([MetricsApp(services), ManagementApp(services)]),
                             "DELETE", "/metrics")
        assert (refused.status, refused.json()) == (405, NOT_ALLOWED)
        # A model the management app does not know is its 404, not a route 404.
        missing = await call(_combined(services), "GET", "/models/ghost")
        assert missing.json() == {"code": 404, "type": "ModelNotFoundException",
                                  "message": "Model not found: ghost"}

    _with_apps(tmp_path, None, test)


def test_apps_ignore_scopes_other_than_http(tmp_path: Path) -> None:
    async def test(services: Services) -> None:
        sent: list[common.Message] = []

        async def receive() -> common.Message:
            raise AssertionError("nothing to receive")

        async def send(message: common.Message) -> None:
            sent.append(message)

        for app in (_combined(services), ManagementApp(services), MetricsApp(services)):
            await app({"type": "lifespan"}, receive, send)
        assert sent == []

    _with_apps(tmp_path, None, test)


def test_a_client_gone_before_its_body_gets_no_answer(build_mar, model_store: Path,
                                                      tmp_path: Path) -> None:
    build_mar("echo", "echo")

    async def test(services: Services) -> None:
        await _echo_without_workers(services)
        sent: list[common.Message] = []

        async def receive() -> common.Message:
            return {"type": "http.disconnect"}

        async def send(message: common.Message) -> None:
            sent.append(message)

        for app in (_combined(services), InferenceApp(services)):
            await app(scope("POST", "/predictions/echo"), receive, send)
        assert sent == []

    _with_apps(tmp_path, model_store, test)


# ---- CountedResponses ------------------------------------------------------------------------


def test_counted_responses_count_each_response_once(tmp_path: Path) -> None:
    async def streamed(scope: common.Scope, receive: common.Receive,
                       send: common.Send) -> None:
        await send({"type": "http.response.start", "status": 201, "headers": []})
        for part in (b"a", b"b"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def test(services: Services) -> None:
        counted: list[int] = []
        await call(CountedResponses(streamed, counted.append), "GET", "/")
        assert counted == [201]
        app = CountedResponses(_combined(services), counted.append)
        for path in ("/ping", "/nowhere", "/models"):
            await call(app, "GET", path)
        await call(app, "POST", "/metrics")
        assert counted == [201, 200, 404, 200, 405]

    _with_apps(tmp_path, None, test)


def test_counted_responses_feed_torchserve_status_counters(tmp_path: Path) -> None:
    async def test(services: Services) -> None:
        app = CountedResponses(_combined(services), services.metrics.count_response)
        for path in ("/ping", "/models", "/nowhere", "/models/ghost"):
            await call(app, "GET", path)
        page = await call(app, "GET", "/metrics", query=b"name[]=Requests2XX&name[]=Requests4XX")
        values = {f.name: f.samples[0].value
                  for f in text_string_to_metric_families(page.body.decode())}
        # The metrics page itself is counted once it is sent, after it was rendered.
        assert values == {"Requests2XX": 2.0, "Requests4XX": 2.0}

    _with_apps(tmp_path, None, test)


# ---- the management app ----------------------------------------------------------------------


def test_management_app_lists_and_describes_in_torchserve_json(build_mar, model_store: Path,
                                                               tmp_path: Path) -> None:
    build_mar("echo", "echo")

    async def test(services: Services) -> None:
        app = ManagementApp(services)
        empty = await call(app, "GET", "/models")
        assert empty.status == 200 and empty.body == b'{\n  "models": []\n}\n'
        registered = await call(app, "POST", "/models",
                                query=b"url=echo.mar&initial_workers=0&batch_size=2")
        assert registered.status == 200
        assert registered.json()["status"].startswith('Model "echo" Version: 1.0 registered')
        listed = await call(app, "GET", "/models", query=b"limit=1")
        assert listed.json() == {"models": [{"modelName": "echo", "modelUrl": "echo.mar"}]}
        [described] = (await call(app, "GET", "/models/echo/1.0")).json()
        assert (described["modelName"], described["batchSize"]) == ("echo", 2)
        scaled = await call(app, "PUT", "/models/echo", query=b"min_worker=0&max_worker=2")
        assert (scaled.status, scaled.json()) == (202, {"status": "Processing worker updates..."})
        made_default = await call(app, "PUT", "/models/echo/1.0/set-default")
        assert made_default.status == 200
        removed = await call(app, "DELETE", "/models/echo")
        assert (removed.status, removed.json()) == (200, {"status": 'Model "echo" unregistered'})

    _with_apps(tmp_path, model_store, test)


@pytest.mark.parametrize(("method", "path", "query", "status", "body"), [
    ("GET", "/models/ghost", b"", 404,
     {"code": 404, "type": "ModelNotFoundException", "message": "Model not found: ghost"}),
    ("GET", "/models/echo/9.9", b"", 404,
     {"code": 404, "type": "ModelVersionNotFoundException",
      "message": "Model version 9.9 does not exist for model echo"}),
    ("GET", "/models", b"limit=x", 400,
     {"code": 400, "type": "BadRequestException",
      "message": "parameter limit must be an integer in [-2147483648, 2147483647], "
                 "got 'x'"}),
    ("POST", "/models", b"", 400,
     {"code": 400, "type": "BadRequestException", "message": "Parameter url is required."}),
    ("PUT", "/models/echo", b"min_worker=2&max_worker=1", 400,
     {"code": 400, "type": "BadRequestException",
      "message": "max_worker cannot be less than min_worker."}),
    ("PATCH", "/models", b"", 405, NOT_ALLOWED),
    ("POST", "/models/echo", b"", 405, NOT_ALLOWED),
    ("GET", "/models/echo/1.0/set-default", b"", 405, NOT_ALLOWED),
    ("PUT", "/models/echo/1.0/make-default", b"", 404, NOT_FOUND),
    ("GET", "/predictions/echo", b"", 404, NOT_FOUND),
    ("GET", "/token", b"type=inference", 400,
     {"code": 400, "type": "BadRequestException",
      "message": "token authorization is disabled on this server"}),
])
def test_management_app_refuses_with_torchserve_error_body(
        build_mar, model_store: Path, tmp_path: Path, method: str, path: str, query: bytes,
        status: int, body: dict[str, Any]) -> None:
    build_mar("echo", "echo")

    async def test(services: Services) -> None:
        await _echo_without_workers(services)
        answer = await call(ManagementApp(services), method, path, query=query)
        assert (answer.status, answer.json()) == (status, body)
        assert services.registry.names() == ["echo"]  # nothing changed

    _with_apps(tmp_path, model_store, test)


def test_management_app_register_is_405_without_the_model_api(build_mar, model_store: Path,
                                                              tmp_path: Path) -> None:
    build_mar("echo", "echo")

    async def test(services: Services) -> None:
        answer = await call(ManagementApp(services), "POST", "/models", query=b"url=echo.mar")
        assert answer.status == 405
        assert answer.json()["type"] == "MethodNotAllowedException"
        assert "--enable-model-api" in answer.json()["message"]

    _with_apps(tmp_path, model_store, test, enable_model_api=False)


def test_api_descriptions_are_served(tmp_path: Path) -> None:
    async def test(services: Services) -> None:
        for app in (InferenceApp(services), ManagementApp(services)):
            for method, path in (("GET", "/api-description"), ("OPTIONS", "/")):
                answer = await call(app, method, path)
                assert answer.status == 200 and answer.json()["openapi"].startswith("3.")

    _with_apps(tmp_path, None, test)


# ---- the metrics app -------------------------------------------------------------------------


def test_metrics_app_answers_prometheus_text(tmp_path: Path) -> None:
    async def test(services: Services) -> None:
        answer = await call(MetricsApp(services), "GET", "/metrics")
        assert answer.status == 200
        # TorchServe's: text format 0.0.4.
        assert answer.headers[b"content-type"] == b"text/plain; version=0.0.4; charset=utf-8"
        assert LEGACY_HELP in answer.body
        assert b"# TYPE ts_inference_requests_total counter\n" in answer.body
        assert {"ts_inference_requests_total", "Requests2XX", "batchserve_batch_size"} \
            <= set(_families(answer.body))

    _with_apps(tmp_path, None, test)


def test_metrics_app_filters_by_name(tmp_path: Path) -> None:
    async def test(services: Services) -> None:
        answer = await call(MetricsApp(services), "GET", "/metrics",
                            query=b"name[]=ts_queue_latency_microseconds&name[]=Requests5XX")
        assert sorted(_families(answer.body)) == ["Requests5XX", "ts_queue_latency_microseconds"]

    _with_apps(tmp_path, None, test)


def test_legacy_metrics_mode_shows_only_torchserve_counters(tmp_path: Path) -> None:
    async def test(services: Services) -> None:
        app = MetricsApp(services)
        everything = await call(app, "GET", "/metrics")
        assert _families(everything.body) == list(LEGACY)
        some = await call(app, "GET", "/metrics",
                          query=b"name[]=ts_queue_latency_microseconds&name[]=Requests2XX")
        assert _families(some.body) == ["ts_queue_latency_microseconds"]

    _with_apps(tmp_path, None, test, metrics_mode="legacy")


def test_legacy_metrics_mode_filter_of_other_names_is_empty(tmp_path: Path) -> None:
    async def test(services: Services) -> None:
        other = await call(MetricsApp(services), "GET", "/metrics", query=b"name[]=Requests2XX")
        assert (other.status, _families(other.body)) == (200, [])

    _with_apps(tmp_path, None, test, metrics_mode="legacy")


def test_metrics_app_refuses_other_paths_and_methods(tmp_path: Path) -> None:
    async def test(services: Services) -> None:
        app = MetricsApp(services)
        assert (await call(app, "GET", "/")).json() == NOT_FOUND
        assert (await call(app, "POST", "/metrics")).json() == NOT_ALLOWED

    _with_apps(tmp_path, None, test)


# ---- the inference app -----------------------------------------------------------------------


def test_ping_says_healthy(build_mar, model_store: Path, tmp_path: Path) -> None:
    build_mar("echo", "echo")

    async def test(services: Services) -> None:
        app = InferenceApp(services)
        assert (await call(app, "GET", "/ping")).body == b'{\n  "status": "Healthy"\n}\n'
        await _echo_without_workers(services)  # no worker is no failing worker
        assert (await call(app, "GET", "/ping")).json() == {"status": "Healthy"}

    _with_apps(tmp_path, model_store, test)


def test_a_prediction_for_a_model_without_workers_is_503(build_mar, model_store: Path,
                                                         tmp_path: Path) -> None:
    build_mar("echo", "echo")

    async def test(services: Services) -> None:
        await _echo_without_workers(services)
        answer = await call(InferenceApp(services), "POST", "/predictions/echo", body=b"hi")
        assert answer.status == 503
        assert answer.json() == {
            "code": 503, "type": "ServiceUnavailableException",
            "message": 'Model "echo" has no worker to serve inference request. Please use '
                       "scale workers API to add workers."}
        page = services.metrics.exposition({"ts_inference_requests_total"}).decode()
        [family] = text_string_to_metric_families(page)
        assert [(s.labels["model_name"], s.value) for s in family.samples] == [("echo", 1.0)]

    _with_apps(tmp_path, model_store, test)


@pytest.mark.parametrize(("method", "path", "headers", "status", "body"), [
    ("GET", "/predictions/echo", [], 405, NOT_ALLOWED),
    ("POST", "/predictions/ghost", [], 404,
     {"code": 404, "type": "ModelNotFoundException", "message": "Model not found: ghost"}),
    ("POST", "/predictions/echo/1.0/extra", [], 404, NOT_FOUND),
    ("POST", "/predictions/echo", [(b"content-length", b"99999999")], 413,
     {"code": 413, "type": "PayloadTooLargeException",
      "message": "request body of 99999999 bytes exceeds max_request_size (6553500 bytes)"}),
    ("POST", "/predictions/echo", [(b"x-request-timeout", b"0")], 400,
     {"code": 400, "type": "BadRequestException",
      "message": "x-request-timeout must be a finite number of seconds > 0, got '0'"}),
    ("GET", "/models", [], 404, NOT_FOUND),
])
def test_inference_app_refusals(build_mar, model_store: Path, tmp_path: Path, method: str,
                                path: str, headers: list[tuple[bytes, bytes]], status: int,
                                body: dict[str, Any]) -> None:
    build_mar("echo", "echo")

    async def test(services: Services) -> None:
        await _echo_without_workers(services)
        answer = await call(InferenceApp(services), method, path, headers=headers)
        assert (answer.status, answer.json()) == (status, body)

    _with_apps(tmp_path, model_store, test)


def test_kserve_v2_server_metadata_and_health(tmp_path: Path) -> None:
    async def test(services: Services) -> None:
        app = InferenceApp(services)
        metadata = await call(app, "GET", "/v2")
        assert metadata.status == 200
        assert metadata.json() == {"name": "batchserve", "version": __version__,
                                   "extensions": ["binary_tensor_data", "parameters"]}
        assert (await call(app, "GET", "/v2/health/live")).json() == {"live": True}
        ready = await call(app, "GET", "/v2/health/ready")
        assert (ready.status, ready.json()) == (200, {"ready": True})  # no model to wait for
        assert (await call(app, "GET", "/v1/models")).json() == {"models": []}

    _with_apps(tmp_path, None, test)


def test_kserve_routes_answer_kserve_errors(build_mar, model_store: Path,
                                            tmp_path: Path) -> None:
    build_mar("echo", "echo")

    async def test(services: Services) -> None:
        app = InferenceApp(services)
        await _echo_without_workers(services)

        async def answer(method: str, path: str, body: bytes = b"") -> tuple[int, object]:
            reply: Reply = await call(app, method, path, body=body)
            return reply.status, reply.json()

        assert await answer("GET", "/v2/models/ghost") == \
            (404, {"error": "Model not found: ghost"})
        assert await answer("POST", "/v2") == \
            (405, {"error": NOT_ALLOWED["message"]})
        assert await answer("GET", "/v2/models/echo/ready") == \
            (503, {"name": "echo", "ready": False})  # no worker
        assert await answer("GET", "/v2/health/ready") == (503, {"ready": False})
        assert await answer("GET", "/v1/models/echo") == (503, {"name": "echo", "ready": False})
        assert await answer("GET", "/v2/models/echo/versions/1.0") == (200, {
            "name": "echo", "versions": ["1.0"], "platform": "pytorch", "inputs": [],
            "outputs": []})
        assert await answer("POST", "/v1/models/echo:predict", b'{"instances": [1]}') == (503, {
            "error": 'Model "echo" has no worker to serve inference request. Please use scale '
                     "workers API to add workers."})

    _with_apps(tmp_path, model_store, test)


def test_the_event_loop_is_left_clean(tmp_path: Path) -> None:
    """No task of an app outlives its request (the receive() watcher included)."""

    async def test(services: Services) -> None:
        for path in ("/ping", "/v2", "/nowhere"):
            await call(_combined(services), "GET", path)
        await asyncio.sleep(0)
        assert asyncio.all_tasks() == {asyncio.current_task()}

    _with_apps(tmp_path, None, test)
