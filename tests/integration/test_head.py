"""HEAD on every GET route of the three ports: GET's status and headers, Content-Length
included, and no content (RFC 9110, 9.3.2). TorchServe answers HEAD /metrics, /ping,
/api-description and KServe's health routes with 200 (its routes there take any method);
here every route that answers GET answers HEAD (frontend/api/http/common.py, HeadAsGet).

The routes come from the OpenAPI descriptions the server serves (every path with a ``get``),
so a GET route added there is checked here too, and from the list of GET routes the
descriptions leave out (``UNDESCRIBED``).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from frontend.api.http.openapi import inference_description, management_description
from model_archiver.packaging import ArchiveOptions, build_archive
from tests.conftest import HANDLERS, RunningServer, launch_server

MODEL, VERSION = "echo", "1.0"
#: Values for the descriptions' path parameters.
PARAMETERS = {"{model_name}": MODEL, "{model_version}": VERSION}
#: GET routes the OpenAPI descriptions do not list, by port.
UNDESCRIBED = {
    "inference": ["/", "/execution-parameters", f"/v1/models/{MODEL}"],
    "management": ["/workflows", "/dashboard", "/dashboard/data", f"/models/{MODEL}/all",
                   "/token?type=inference", f"/models/{MODEL}?customized=true"],
    "metrics": ["/metrics", "/metrics?name[]=ts_inference_requests_total"],
}
#: Answers that change from one call to the next: the dashboard's clock and samples, the
#: response counters (Requests2XX) on the whole metrics page, a worker's customized metadata.
LIVE = {"/dashboard/data", "/metrics", f"/models/{MODEL}?customized=true"}
#: Error answers: HEAD gets GET's status and headers for these too.
ERRORS = {
    "inference": ["/v2/models/ghost", "/v1/models/ghost", "/nowhere",
                  f"/predictions/{MODEL}"],  # 405: predictions take POST and PUT
    "management": ["/models/ghost", "/models/echo/9.9", "/workflows/ghost"],
    "metrics": ["/nowhere"],
}


def _get_paths(description: dict[str, object]) -> list[str]:
    paths = description["paths"]
    assert isinstance(paths, dict)
    routes = []
    for path, operations in paths.items():
        if "get" in operations:
            for name, value in PARAMETERS.items():
                path = path.replace(name, value)
            assert "{" not in path, f"no value for a parameter of {path}"
            routes.append(path)
    return routes


ROUTES = {
    "inference": _get_paths(inference_description()) + UNDESCRIBED["inference"],
    "management": _get_paths(management_description()) + UNDESCRIBED["management"],
    "metrics": UNDESCRIBED["metrics"],
}
CASES = [(port, path) for port, paths in ROUTES.items() for path in paths] + \
    [(port, path) for port, paths in ERRORS.items() for path in paths]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    store: Path = tmp_path_factory.mktemp("head") / "model_store"
    store.mkdir()
    build_archive(ArchiveOptions(model_name=MODEL, version=VERSION,
                                 handler=str(HANDLERS / "echo.py"), export_path=store))
    # Under KServe (kserve_protocol) "/" answers GET too; its REST port is a new one here.
    running = launch_server(store, f"{MODEL}.mar", kserve_protocol="v2", kserve_rest_port=0,
                            kserve_grpc_port=0)
    try:
        # One prediction, so that the inference counter is on the metrics page.
        assert running.predict(MODEL, b"x").status_code == 200
        yield running
    finally:
        running.stop()


def _base(server: RunningServer, port: str) -> str:
    return {"inference": server.inference, "management": server.management,
            "metrics": server.metrics}[port]


def test_every_get_route_is_checked() -> None:
    """The routes the descriptions list, and those they leave out, are all here."""
    assert {"/ping", "/api-description", "/v2/health/live", f"/v2/models/{MODEL}/ready",
            f"/v2/models/{MODEL}/versions/{VERSION}"} <= set(ROUTES["inference"])
    assert {"/models", f"/models/{MODEL}", f"/models/{MODEL}/{VERSION}", "/token"} <= set(
        ROUTES["management"])


@pytest.mark.parametrize(("port", "path"), CASES)
def test_head_answers_as_get_without_the_content(server: RunningServer, port: str,
                                                 path: str) -> None:
    url = _base(server, port) + path
    with requests.Session() as session:  # one connection: stray content would break the next
        deadline = time.monotonic() + 10
        while True:
            got = session.get(url, timeout=30)
            head = session.head(url, timeout=30)
            again = session.get(url, timeout=30)
            # A LIVE answer may change from one call to the next (its length too, now and
            # then): try again until the three agree on the length, or the time is up.
            lengths = {str(len(got.content)), head.headers.get("content-length"),
                       str(len(again.content))}
            if len(lengths) == 1 or time.monotonic() > deadline:
                break
    assert head.status_code == got.status_code, (path, got.text)
    assert head.status_code != 405 or path.startswith("/predictions/"), path
    assert head.content == b""
    assert head.headers.get("content-type") == got.headers.get("content-type")
    assert head.headers["content-length"] == str(len(got.content)), path
    assert path in LIVE or got.content == again.content, f"{path} changed between two GETs"


@pytest.mark.parametrize("port", ["inference", "management", "metrics"])
def test_a_head_answer_ends_at_its_headers_on_the_wire(server: RunningServer,
                                                       port: str) -> None:
    """Pipelined HEAD then GET on one raw connection: the HEAD's answer is its head alone,
    and the next bytes are the GET's status line."""
    path = {"inference": "/ping", "management": "/models", "metrics": "/metrics"}[port]
    address = urlsplit(_base(server, port))
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(f"HEAD {path} HTTP/1.1\r\nHost: t\r\n\r\n"
                     f"GET /nowhere HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        received = b""
        while received.count(b"HTTP/1.1 ") < 2 or not received.endswith(b"}\n"):
            chunk = sock.recv(65536)
            assert chunk, f"connection closed; got {received!r}"
            received += chunk
    head, _, rest = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n"), head
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    assert length > 0
    assert rest.startswith(b"HTTP/1.1 404 "), rest[:80]


def test_head_on_token_is_refused_and_rotates_no_key(
        build_mar: Callable[..., Path], start_server: Callable[..., RunningServer],
        tmp_path: Path) -> None:
    """``GET /token`` rotates a key that only its answer carries: a HEAD would rotate it for
    nobody (the old key dead, the new one unsent), so it is refused; GET still rotates."""
    build_mar(MODEL, "echo")
    key_file = tmp_path / "key_file.json"
    server = start_server(f"{MODEL}.mar", disable_token_authorization=False, key_file=key_file)
    keys = json.loads(key_file.read_text())
    api = {"Authorization": f"Bearer {keys['API']['key']}"}
    url = f"{server.management}/token?type=inference"
    head = requests.head(url, headers=api, timeout=30)
    assert head.status_code == 405 and head.content == b""
    assert json.loads(key_file.read_text()) == keys
    inference = {"Authorization": f"Bearer {keys['inference']['key']}"}
    assert server.predict(MODEL, b"still", headers=inference).content == b"still"
    rotated = requests.get(url, headers=api, timeout=30)
    assert rotated.status_code == 200
    assert rotated.json()["inference"]["key"] != keys["inference"]["key"]
