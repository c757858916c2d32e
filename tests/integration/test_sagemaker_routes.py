"""SageMaker's routes on the inference API, as TorchServe 0.12 serves them: ``/invocations``
(the model from ``model_name``, else the single start-up model, else a form field),
``/models/{name}/invoke`` and ``/execution-parameters``.

One server serves inference and management on one listener, as the SageMaker toolkit starts
TorchServe (both on port 8080), with tokens and CORS on: its SageMaker routes predict while
every management route still works there. A second, with two start-up models and its APIs
on ports of their own, covers the model-name rules that need two start-up models and the
inference port's 404s.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from frontend.config import Address
from model_archiver.packaging import ArchiveOptions, build_archive
from tests.conftest import HANDLERS, RunningServer, launch_server

ORIGIN = "http://app.example"
#: max_request_size of the shared server: 3 MiB and a bit (execution-parameters says 3).
MAX_REQUEST_SIZE = 3 * 1024 * 1024 + 100
#: The headers SageMaker sends with an invocation.
SAGEMAKER_HEADERS = {"Content-Type": "application/json", "Accept": "text/csv",
                     "X-Amzn-SageMaker-Custom-Attributes": "trace=1,tenant=a b"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def build(store: Path, *names: str) -> None:
    for name in names:
        build_archive(ArchiveOptions(model_name=name, version="1.0",
                                     handler=str(HANDLERS / "request_probe.py"),
                                     export_path=store, force=True))


@dataclass
class Shared:
    """The server whose inference and management APIs share one listener (``url``)."""

    server: RunningServer
    url: str
    keys: dict[str, str]
    logs: Path

    def auth(self, kind: str = "inference") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[kind]}"}


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    root = tmp_path_factory.mktemp("sagemaker")
    store = root / "model_store"
    store.mkdir()
    build(store, "probe", "other")
    address = Address("127.0.0.1", free_port())
    server = launch_server(store, "probe=probe.mar", inference_address=address,
                           management_address=address, disable_token_authorization=False,
                           key_file=root / "key_file.json", cors_allowed_origin=ORIGIN,
                           max_request_size_bytes=MAX_REQUEST_SIZE)
    try:
        keys = json.loads((root / "key_file.json").read_text())
        handle = Shared(server, server.inference,
                        {kind: keys[kind]["key"] for kind in ("inference", "management")},
                        root / "logs")
        # Registered through the management API, not at start-up: /invocations still means
        # the one start-up model.
        registered = requests.post(f"{handle.url}/models", headers=handle.auth("management"),
                                   params={"url": "other.mar", "initial_workers": 1,
                                           "synchronous": "true"}, timeout=60)
        assert registered.status_code == 200, registered.text
        yield handle
    finally:
        server.stop()


def answer(response: requests.Response) -> dict[str, object]:
    """What the request_probe handler saw (failing with the response's text otherwise)."""
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def error(response: requests.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["code"] == status
    return body["message"]  # type: ignore[no-any-return]


def test_the_listener_serves_both_apis(shared: Shared) -> None:
    assert shared.server.inference == shared.server.management == shared.url


def test_invocations_without_a_model_name_go_to_the_single_startup_model(
        shared: Shared) -> None:
    seen = answer(requests.post(f"{shared.url}/invocations", data=b'{"x": [1, 2]}',
                                headers={**SAGEMAKER_HEADERS, **shared.auth()}, timeout=30))
    assert seen["model"] == "probe"
    assert seen["inputs"] == {"body": '{"x": [1, 2]}'}
    headers = seen["headers"]
    assert isinstance(headers, dict)
    # Content type, Accept and every other header reach the handler, as for /predictions.
    assert headers["content-type"] == "application/json"
    assert headers["accept"] == "text/csv"
    assert headers["x-amzn-sagemaker-custom-attributes"] == "trace=1,tenant=a b"
    # An empty model_name is no name: still the start-up model (TorchServe's rule).
    seen = answer(requests.post(f"{shared.url}/invocations?model_name=", data=b"e",
                                headers=shared.auth(), timeout=30))
    assert seen["model"] == "probe"
    assert seen["inputs"] == {"model_name": "", "body": "e"}


def test_invocations_name_their_model_and_query_parameters_are_inputs(shared: Shared) -> None:
    seen = answer(requests.post(f"{shared.url}/invocations",
                                params=[("model_name", "other"), ("k", "v 1"), ("n", "2")],
                                data=b"payload", headers=shared.auth(), timeout=30))
    assert seen["model"] == "other"
    assert seen["inputs"] == {"model_name": "other", "k": "v 1", "n": "2", "body": "payload"}
    # The first model_name counts; the body wins over a query parameter of its name.
    seen = answer(requests.post(f"{shared.url}/invocations?model_name=other&model_name=probe"
                                "&body=lost", data=b"kept", headers=shared.auth(), timeout=30))
    assert seen["model"] == "other"
    assert seen["inputs"] == {"model_name": "probe", "body": "kept"}
    message = error(requests.post(f"{shared.url}/invocations?model_name=nosuch", data=b"x",
                                  headers=shared.auth(), timeout=30), 404)
    assert message == "Model not found: nosuch"


def test_models_invoke_predicts_with_the_model_of_its_path(shared: Shared) -> None:
    seen = answer(requests.put(f"{shared.url}/models/other/invoke?model_name=probe&q=1",
                               data=b"p", headers={**SAGEMAKER_HEADERS, **shared.auth()},
                               timeout=30))
    assert seen["model"] == "other"  # the path's model; model_name is only an input
    assert seen["inputs"] == {"model_name": "probe", "q": "1", "body": "p"}
    assert seen["headers"]["x-amzn-sagemaker-custom-attributes"] == "trace=1,tenant=a b"  # type: ignore[index]
    message = error(requests.post(f"{shared.url}/models/nosuch/invoke", data=b"x",
                                  headers=shared.auth(), timeout=30), 404)
    assert message == "Model not found: nosuch"
    # A prediction route: POST and PUT, as /predictions.
    assert requests.get(f"{shared.url}/models/other/invoke", headers=shared.auth(),
                        timeout=30).status_code == 405


def test_pipelined_invocations_are_answered_in_order(shared: Shared) -> None:
    """The second of two requests sent at once goes the ASGI way (behind an unanswered one),
    the first the connection's fast path: both answer as the same route."""
    token = shared.keys["inference"]
    host, port = shared.url.removeprefix("http://").split(":")
    head = ("POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token +
            "\r\nContent-Length: {length}\r\n\r\n{body}")
    wire = (head.format(path="/invocations?i=1", length=2, body="b1") +
            head.format(path="/models/other/invoke?i=2", length=2, body="b2")).encode()
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(wire)
        received = b""
        while received.count(b'"headers"') < 2:
            chunk = conn.recv(65536)
            assert chunk, f"connection closed after {received!r}"
            received += chunk
    bodies = [json.loads(part[part.index(b"{"):])
              for part in received.split(b"HTTP/1.1 ")[1:]]
    assert [(b["model"], b["inputs"]) for b in bodies] == [
        ("probe", {"i": "1", "body": "b1"}), ("other", {"i": "2", "body": "b2"})]


def test_management_routes_work_on_the_shared_listener(shared: Shared) -> None:
    url, auth = shared.url, shared.auth("management")
    listed = requests.get(f"{url}/models", headers=auth, timeout=30)
    assert listed.status_code == 200, listed.text
    assert {m["modelName"] for m in listed.json()["models"]} >= {"probe", "other"}
    # Describe with a version (a /models/{m}/{v} path that is not .../invoke).
    described = requests.get(f"{url}/models/probe/1.0", headers=auth, timeout=30)
    assert described.status_code == 200, described.text
    assert described.json()[0]["modelVersion"] == "1.0"
    assert described.json()[0]["loadedAtStartup"] is True
    assert requests.get(f"{url}/models/probe/9.9", headers=auth,
                        timeout=30).status_code == 404
    scaled = requests.put(f"{url}/models/other", params={"min_worker": 2,
                                                         "synchronous": "true"},
                          headers=auth, timeout=60)
    assert scaled.status_code == 200, scaled.text
    assert len(requests.get(f"{url}/models/other/1.0", headers=auth,
                            timeout=30).json()[0]["workers"]) == 2
    assert requests.delete(f"{url}/models/other", headers=auth, timeout=60).status_code == 200
    assert error(requests.post(f"{url}/models/other/invoke", data=b"x", headers=shared.auth(),
                               timeout=30), 404) == "Model not found: other"
    registered = requests.post(f"{url}/models", headers=auth,
                               params={"url": "other.mar", "initial_workers": 1,
                                       "synchronous": "true"}, timeout=60)
    assert registered.status_code == 200, registered.text
    assert answer(requests.post(f"{url}/models/other/invoke", data=b"x",
                                headers=shared.auth(), timeout=30))["model"] == "other"
    # Each API keeps its own key on the shared listener.
    assert requests.get(f"{url}/models", headers=shared.auth(), timeout=30).status_code == 401


def test_each_request_is_its_one_routes_on_the_shared_listener(shared: Shared) -> None:
    """Issue 32: one route table for both APIs, the inference API's routes first (as its app
    was tried first): a POST is found once, by the connection, and served by its route's app
    whether that is the fast path, an ASGI inference route or a management route."""
    url = shared.url
    description = requests.options(f"{url}/", timeout=30)
    assert description.json()["info"]["title"] == "batchserve inference API"
    assert requests.get(f"{url}/api-description", timeout=30).json()["info"]["title"] == \
        "batchserve inference API"
    # POSTs the connection finds and hands to the ASGI apps: any method on /ping, a workflow
    # (the inference API's), a management registration refused for its key.
    assert requests.post(f"{url}/ping", timeout=30).json() == {"status": "Healthy"}
    missing = requests.post(f"{url}/wfpredict/nosuch", data=b"x", headers=shared.auth(),
                            timeout=30)
    assert missing.status_code == 404
    assert missing.json()["type"] == "WorkflowNotFoundException", missing.text
    assert requests.post(f"{url}/models", params={"url": "x.mar"}, headers=shared.auth(),
                         timeout=30).status_code == 401
    # A prediction route that names no model, and the management API's live page.
    extra = requests.post(f"{url}/predictions/probe/1.0/extra", data=b"x",
                          headers=shared.auth(), timeout=30)
    assert extra.status_code == 404 and extra.json()["type"] == "ResourceNotFoundException"
    page = requests.get(f"{url}/dashboard", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")


def test_tokens_and_cors_as_for_predictions(shared: Shared) -> None:
    url = shared.url
    for path in ("/invocations", "/models/probe/invoke"):
        refused = requests.post(f"{url}{path}", data=b"x", timeout=30,
                                headers={"Origin": ORIGIN})
        assert refused.status_code == 401, path
        assert refused.headers["Access-Control-Allow-Origin"] == ORIGIN
        wrong = requests.post(f"{url}{path}", data=b"x", headers=shared.auth("management"),
                              timeout=30)
        assert wrong.status_code == 401, path
        served = requests.post(f"{url}{path}", data=b"x", timeout=30,
                               headers={"Origin": ORIGIN, **shared.auth()})
        assert answer(served)["model"] == "probe"
        assert served.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert requests.get(f"{url}/execution-parameters", timeout=30).status_code == 401


def test_execution_parameters(shared: Shared) -> None:
    url, auth = shared.url, shared.auth("management")
    got = requests.get(f"{url}/execution-parameters", headers=shared.auth(), timeout=30)
    assert got.status_code == 200, got.text
    # Each model's workers times its batch size: the requests it can run at once.
    slots = 0
    for model in requests.get(f"{url}/models", headers=auth, timeout=30).json()["models"]:
        described = requests.get(f"{url}/models/{model['modelName']}", headers=auth,
                                 timeout=30).json()[0]
        slots += len(described["workers"]) * described["batchSize"]
    assert got.json() == {"MaxConcurrentTransforms": slots, "BatchStrategy": "MULTI_RECORD",
                          "MaxPayloadInMB": 3}
    assert requests.post(f"{url}/execution-parameters", headers=shared.auth(),
                         timeout=30).status_code == 405
    # The payload limit it states is the one /invocations keeps.
    too_big = requests.post(f"{url}/invocations", data=b"x" * (MAX_REQUEST_SIZE + 1),
                            headers=shared.auth(), timeout=30)
    assert too_big.status_code == 413


def test_invocations_are_counted_and_logged_as_predictions(shared: Shared) -> None:
    def requests_total() -> float:
        text = requests.get(f"{shared.server.metrics}/metrics", timeout=30).text
        return sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples
                   if sample.name == "ts_inference_requests_total"
                   and sample.labels.get("model_name") == "probe")

    before = requests_total()
    for _ in range(3):
        answer(requests.post(f"{shared.url}/invocations?tag=counted", data=b"c",
                             headers=shared.auth(), timeout=30))
    shared.server.wait_for(lambda: requests_total() == before + 3, "three more requests")
    access = shared.logs / "access_log.log"

    def logged() -> int:
        # TorchServe's line: the request line's target as sent, its query too.
        text = access.read_text() if access.exists() else ""
        return sum('"POST /invocations?tag=counted HTTP/1.1" 200 ' in line
                   for line in text.splitlines())

    shared.server.wait_for(lambda: logged() >= 3, "the invocations' access-log lines")
    assert logged() == 3  # one line each


# ---- two start-up models, each API on its own port ------------------------------------------


def test_two_startup_models_need_a_name(
        model_store: Path, start_server: Callable[..., RunningServer]) -> None:
    build(model_store, "a", "b")
    server = start_server("a=a.mar", "b=b.mar")
    url = server.inference
    message = error(requests.post(f"{url}/invocations", data=b"{}",
                                  headers={"Content-Type": "application/json"}, timeout=30),
                    400)
    assert message == "Parameter model_name is required."
    # A JSON body's "model_name" is not a request parameter.
    assert requests.post(f"{url}/invocations", json={"model_name": "a"},
                         timeout=30).status_code == 400
    # An empty name is looked up as it is.
    assert error(requests.post(f"{url}/invocations?model_name=", data=b"x", timeout=30),
                 404) == "Model not found: "
    # A form names it: multipart or urlencoded, its fields the inputs.
    seen = answer(requests.post(f"{url}/invocations", timeout=30,
                                files={"model_name": (None, "b"), "data": ("d.txt", b"D")}))
    assert seen["model"] == "b" and seen["inputs"] == {"model_name": "b", "data": "D"}
    seen = answer(requests.post(f"{url}/invocations", data={"model_name": "a", "data": "E"},
                                timeout=30))
    assert seen["model"] == "a"
    assert error(requests.post(f"{url}/invocations", files={"data": ("d.txt", b"D")},
                               timeout=30), 400) == "Parameter model_name is required."
    assert answer(requests.post(f"{url}/invocations?model_name=a", data=b"x",
                                timeout=30))["model"] == "a"
    # On an inference-only port, every other /models/... path and /invocations/... is 404.
    for method, path in (("POST", "/models/a/predict"), ("GET", "/models/a/1.0"),
                         ("GET", "/models"), ("POST", "/invocations/a"),
                         ("POST", "/models/a/invoke/x")):
        assert requests.request(method, f"{url}{path}", timeout=30).status_code == 404, path
    # One start-up model left: /invocations means it again.
    assert requests.delete(f"{server.management}/models/b", timeout=60).status_code == 200
    assert answer(requests.post(f"{url}/invocations", data=b"x", timeout=30))["model"] == "a"
