"""One server, started as a user starts it (``torchserve --start --foreground`` with a
config.properties and TorchServe's flags), token authorization on, for issue 22's parts 5
and 6 where they need a running server:

- CORS (``cors_allowed_*``): preflights answered on every port without a token, the
  Access-Control-* headers on every port's answers (the /predictions fast path, a streamed
  answer, errors, management, metrics), none for an origin not allowed; then a real browser
  (headless Chromium) fetching cross-origin from a page of another origin: allowed, and
  blocked from an origin that is not;
- TorchServe's legacy routes ``/{model}/predict`` and ``/{model}/{version}/predict``: the same
  queue, batching, errors and tokens as /predictions, and query parameters as inputs;
- model-config.yaml's parallelism and device keys in describe (REST and gRPC) as TorchServe
  shows them, and the log lines that say what they, TorchServe's no-effect config keys and
  its no-effect flags do here; ``deviceType: cpu`` (on a server of its own, with simulated
  GPUs) keeping a model's workers off the GPUs.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
import requests

from model_archiver.packaging import ArchiveOptions, build_archive
from protos import management_pb2, management_pb2_grpc
from tests.conftest import HANDLERS, ServerProcess, spawn_server
from tests.integration.browser import chromium_or_skip

METHODS = "GET, POST, PUT, OPTIONS"
HEADERS = "Authorization, Content-Type, X-Custom"
MODEL_CONFIG = """\
batchSize: 4
maxBatchDelay: 100
parallelType: tp
deviceType: cpu
continuousBatching: true
useJobTicket: true
asyncCommunication: true
torchrun:
  nproc-per-node: 2
"""


class _Pages(BaseHTTPRequestHandler):
    """Serves the browser test's pages (``pages``: path -> HTML) from another origin, and
    takes what a page POSTs to ``/report`` (its results) into ``reports``."""

    pages: dict[str, bytes] = {}
    reports: queue.Queue[bytes] = queue.Queue()

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        self.send_response(204 if self.path == "/report" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()
        if self.path == "/report":
            self.reports.put(body)

    def do_GET(self) -> None:
        page = self.pages.get(self.path)
        self.send_response(200 if page is not None else 404)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(page or b"")))
        self.end_headers()
        self.wfile.write(page or b"")

    def log_message(self, format: str, *args: object) -> None:
        pass


@dataclass
class Served:
    server: ServerProcess
    #: The origin the server allows (the page server's) and one it does not (the same page
    #: server under another host name).
    origin: str
    blocked_origin: str
    pages: dict[str, bytes]
    reports: queue.Queue[bytes]
    keys: dict[str, str]
    root: Path

    def auth(self, kind: str = "inference") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[kind]}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("cors")
    store = root / "model_store"
    store.mkdir()
    model_config = root / "model-config.yaml"
    model_config.write_text(MODEL_CONFIG)
    for name, handler, config_file in (("probe", "inputs_probe.py", str(model_config)),
                                       ("streamer", "streamer.py", None)):
        build_archive(ArchiveOptions(model_name=name, version="1.0",
                                     handler=str(HANDLERS / handler), export_path=store,
                                     force=True, config_file=config_file))
    pages: dict[str, bytes] = {}
    reports: queue.Queue[bytes] = queue.Queue()
    page_server = ThreadingHTTPServer(
        ("127.0.0.1", 0), type("Pages", (_Pages,), {"pages": pages, "reports": reports}))
    threading.Thread(target=page_server.serve_forever, daemon=True).start()
    port = page_server.server_address[1]
    work = root / "server"
    work.mkdir()
    config = {"cors_allowed_origin": f"http://127.0.0.1:{port}",
              "cors_allowed_methods": METHODS, "cors_allowed_headers": HEADERS,
              # TorchServe's keys that mean nothing here: each accepted, with one log line.
              "vmargs": "-Xmx4g -XX:+UseContainerSupport", "netty_client_threads": 4,
              "async_logging": "true"}
    # TorchServe's flags: --dt is not given (tokens stay on); these are accepted and logged.
    flags = ("--ppath", str(root), "--workflow-store", str(root), "--async",
             "--sock-type", "unix")
    # blacklist_env_vars: the workers do not inherit the server's variables it matches.
    config["blacklist_env_vars"] = "BS_TEST_SECRET_.*"
    secrets = {"BS_TEST_SECRET_TOKEN": "hidden", "BS_TEST_VISIBLE": "shown"}
    os.environ.update(secrets)
    try:
        server = spawn_server(work, store, "probe=probe.mar", "streamer=streamer.mar",
                              config=config, flags=flags)
    finally:
        for name in secrets:
            del os.environ[name]
    try:
        keys = json.loads((work / "key_file.json").read_text())
        yield Served(server, f"http://127.0.0.1:{port}", f"http://localhost:{port}", pages,
                     reports,
                     {kind: keys[kind]["key"] for kind in ("inference", "management")}, root)
    finally:
        server.stop()
        page_server.shutdown()
        page_server.server_close()


def _cors(response: requests.Response) -> dict[str, str]:
    return {name.lower(): value for name, value in response.headers.items()
            if name.lower().startswith("access-control-")}


def _allowed(origin: str) -> dict[str, str]:
    return {"access-control-allow-origin": origin, "access-control-allow-methods": METHODS,
            "access-control-allow-headers": HEADERS}


# ---- CORS with a real HTTP client ----------------------------------------------------------


def test_a_preflight_is_answered_on_every_port_without_a_token(served: Served) -> None:
    server = served.server
    preflight = {"Access-Control-Request-Method": "PUT",
                 "Access-Control-Request-Headers": "authorization,x-custom"}
    for url in (f"{server.inference}/predictions/probe", f"{server.inference}/probe/predict",
                f"{server.management}/models/probe", f"{server.metrics}/metrics"):
        answer = requests.options(url, headers={"Origin": served.origin, **preflight},
                                  timeout=30)
        assert answer.status_code == 200, (url, answer.text)
        assert _cors(answer) == _allowed(served.origin), url
        assert answer.headers["Vary"] == "Origin"
        assert answer.content == b""
        refused = requests.options(url, headers={"Origin": served.blocked_origin, **preflight},
                                   timeout=30)
        assert _cors(refused) == {}, url


def test_every_port_answers_with_cors_headers_for_an_allowed_origin(served: Served) -> None:
    server = served.server
    origin = {"Origin": served.origin}
    answers = {
        # The fast path: a prediction, and its refusals (no token; no such model).
        "prediction": requests.post(f"{server.inference}/predictions/probe", data=b"x",
                                    headers={**origin, **served.auth()}, timeout=30),
        "no token": requests.post(f"{server.inference}/predictions/probe", data=b"x",
                                  headers=origin, timeout=30),
        "no model": requests.post(f"{server.inference}/predictions/nosuch", data=b"x",
                                  headers={**origin, **served.auth()}, timeout=30),
        "legacy": requests.post(f"{server.inference}/probe/predict", data=b"x",
                                headers={**origin, **served.auth()}, timeout=30),
        "stream": requests.post(f"{server.inference}/predictions/streamer", data=b"s",
                                headers={**origin, **served.auth()}, timeout=30),
        "ping": requests.get(f"{server.inference}/ping", headers=origin, timeout=30),
        "describe": requests.get(f"{server.management}/models/probe",
                                 headers={**origin, **served.auth("management")}, timeout=30),
        "metrics": requests.get(f"{server.metrics}/metrics", headers=origin, timeout=30),
    }
    statuses = {name: answer.status_code for name, answer in answers.items()}
    assert statuses == {"prediction": 200, "no token": 401, "no model": 404, "legacy": 200,
                        "stream": 200, "ping": 200, "describe": 200, "metrics": 200}
    assert answers["stream"].text == "s part 1\ns part 2\ns part 3\n"
    for name, answer in answers.items():
        assert _cors(answer) == _allowed(served.origin), name
    # A client that sends no Origin (not a browser's cross-origin request) gets TorchServe's
    # headers; an origin not allowed gets none, though it is answered.
    plain = requests.get(f"{server.inference}/ping", timeout=30)
    assert _cors(plain) == _allowed(served.origin)
    for url, headers in ((f"{server.inference}/predictions/probe", served.auth()),
                         (f"{server.inference}/predictions/streamer", served.auth())):
        other = requests.post(url, data=b"x", timeout=30,
                              headers={"Origin": served.blocked_origin, **headers})
        assert other.status_code == 200 and _cors(other) == {}, url


# ---- CORS in a browser -----------------------------------------------------------------------


_MAIN_PAGE = """<!doctype html><html><body>
<iframe src="BLOCKED/blocked.html"></iframe>
<script>
const results = {};
function done() {
  if (Object.keys(results).length === 5) {
    fetch("/report", {method: "POST", body: JSON.stringify(results)});
  }
}
async function attempt(name, url, init) {
  try {
    const answer = await fetch(url, init);
    results[name] = {status: answer.status, body: await answer.text()};
  } catch (error) {
    results[name] = {error: String(error)};
  }
  done();
}
window.addEventListener("message", (event) => { results.blocked = event.data; done(); });
attempt("prediction", "INFERENCE/predictions/probe", {method: "POST", body: '{"from": "page"}',
  headers: {"Authorization": "Bearer IKEY", "Content-Type": "application/json",
            "X-Custom": "1"}});
attempt("legacy", "INFERENCE/probe/1.0/predict?via=legacy", {method: "PUT", body: "put",
  headers: {"Authorization": "Bearer IKEY"}});
attempt("describe", "MANAGEMENT/models/probe", {headers: {"Authorization": "Bearer MKEY"}});
attempt("metrics", "METRICS/metrics?name[]=Requests2XX", {});
</script></body></html>
"""

_BLOCKED_PAGE = """<!doctype html><html><body><script>
fetch("INFERENCE/predictions/probe", {method: "POST", body: "from a page not allowed"})
  .then((answer) => parent.postMessage({status: answer.status}, "*"))
  .catch((error) => parent.postMessage({error: String(error)}, "*"));
</script></body></html>
"""


def _page(template: str, served: Served) -> bytes:
    server = served.server
    for name, value in (("INFERENCE", server.inference), ("MANAGEMENT", server.management),
                        ("METRICS", server.metrics), ("BLOCKED", served.blocked_origin),
                        ("IKEY", served.keys["inference"]), ("MKEY", served.keys["management"])):
        template = template.replace(name, value)
    return template.encode()


def test_a_browser_fetches_across_origins_only_from_the_allowed_origin(
        served: Served, tmp_path: Path) -> None:
    """One Chromium run: a page of the allowed origin fetches from each port (preflighted:
    a token, a custom header, JSON, PUT), and a frame of another origin is blocked."""
    chromium = chromium_or_skip()
    served.pages["/main.html"] = _page(_MAIN_PAGE, served)
    served.pages["/blocked.html"] = _page(_BLOCKED_PAGE, served)
    # Chromium keeps the page open until it is stopped; the page POSTs its results to its own
    # origin once all five fetches are answered, and the test waits for them with a deadline.
    # (A --dump-dom run with a virtual time budget may dump before real fetches finish.)
    chromium_log = tmp_path / "chromium.log"
    with chromium_log.open("wb") as log:
        browser = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--disable-quic", "--disable-background-networking",
             "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}",
             f"{served.origin}/main.html"],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        text = served.reports.get(timeout=120).decode()
    except queue.Empty:
        text = ""
    finally:
        browser.terminate()
        try:
            browser.wait(timeout=30)
        except subprocess.TimeoutExpired:
            browser.kill()
            browser.wait(timeout=30)
    assert text, f"the page sent no results in 120 s: {chromium_log.read_text()[-2000:]}"
    results = json.loads(text)
    assert results["prediction"].get("status") == 200, results
    assert json.loads(results["prediction"]["body"])["inputs"]["body"] == ["dict",
                                                                           '{"from": "page"}']
    assert results["legacy"].get("status") == 200, results
    legacy = json.loads(results["legacy"]["body"])
    assert legacy["inputs"]["via"] == ["bytes", "legacy"]
    assert results["describe"].get("status") == 200, results
    assert json.loads(results["describe"]["body"])[0]["modelName"] == "probe"
    assert results["metrics"].get("status") == 200 and "Requests2XX" in results["metrics"]["body"]
    # The browser refused the other origin the answer: fetch() failed, no status to read.
    assert "error" in results["blocked"] and "status" not in results["blocked"], results


# ---- TorchServe's legacy routes -----------------------------------------------------------


def test_legacy_routes_predict_as_predictions_do(served: Served, tmp_path: Path) -> None:
    base = served.server.inference
    management = served.server.management
    auth = served.auth()

    def in_flight() -> int:
        return int(requests.get(f"{management}/models/probe", headers=served.auth("management"),
                                timeout=30).json()[0]["batching"]["inFlightBatches"])

    # One queue: with the worker held busy, two requests by each route (batchSize 4) fill
    # the next batch together.
    gate = tmp_path / "gate"
    urls = [f"{base}/predictions/probe", f"{base}/probe/predict",
            f"{base}/predictions/probe/1.0", f"{base}/probe/1.0/predict?a=1&b=two"]
    with ThreadPoolExecutor(5) as pool:
        held = pool.submit(requests.post, f"{base}/predictions/probe", data=b"held",
                           headers={**auth, "X-Wait-For": str(gate)}, timeout=60)
        served.server.wait_for(lambda: in_flight() == 1, "the held batch")
        batched = [pool.submit(requests.post, url, data=b"body", headers=auth, timeout=60)
                   for url in urls]
        served.server.wait_for(lambda: in_flight() == 2, "a full second batch")
        gate.touch()
        assert held.result().json()["batch"] == 1
        answers = [future.result() for future in batched]
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    bodies = [a.json() for a in answers]
    assert [b["batch"] for b in bodies] == [4] * 4
    # Query parameters are inputs on the legacy route only (as TorchServe), as bytes.
    assert bodies[3]["inputs"] == {"a": ["bytes", "1"], "b": ["bytes", "two"],
                                   "body": ["bytes", "body"]}
    assert set(bodies[0]["inputs"]) == {"body"}

    # Errors, the same on both routes.
    def both(method: str, legacy: str, modern: str, **kwargs: object) -> None:
        old = requests.request(method, f"{base}{legacy}", timeout=30, **kwargs)  # type: ignore[arg-type]
        new = requests.request(method, f"{base}{modern}", timeout=30, **kwargs)  # type: ignore[arg-type]
        assert (old.status_code, old.json()) == (new.status_code, new.json()), legacy

    both("POST", "/nosuch/predict", "/predictions/nosuch", headers=auth)
    both("POST", "/probe/9.9/predict", "/predictions/probe/9.9", headers=auth)
    both("POST", "/probe/predict", "/predictions/probe")  # no token: 401
    both("GET", "/probe/predict", "/predictions/probe", headers=auth)  # 405
    unauthorised = requests.post(f"{base}/probe/predict", data=b"x", timeout=30)
    assert unauthorised.status_code == 401
    # Paths TorchServe routes elsewhere are not legacy routes.
    assert requests.post(f"{base}/models/probe/predict", headers=auth,
                         timeout=30).status_code == 404


def test_workers_do_not_inherit_variables_blacklist_env_vars_matches(served: Served) -> None:
    answer = requests.post(f"{served.server.inference}/predictions/probe", data=b"x",
                           timeout=30, headers={**served.auth(),
                                                "X-Env": "BS_TEST_SECRET_TOKEN,BS_TEST_VISIBLE"})
    assert answer.json()["env"] == {"BS_TEST_SECRET_TOKEN": None, "BS_TEST_VISIBLE": "shown"}


# ---- model-config.yaml keys in describe, and the log --------------------------------------


def test_describe_shows_model_config_keys_as_torchserve(served: Served) -> None:
    server = served.server
    expected = {"parallelType": "tp", "parallelLevel": 2, "deviceType": "cpu",
                "continuousBatching": True, "useJobTicket": True, "batchSize": 4}
    described = requests.get(f"{server.management}/models/probe", timeout=30,
                             headers=served.auth("management")).json()[0]
    assert {key: described[key] for key in expected} == expected
    assert "deviceIds" not in described
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_management_port}") as channel:
        stub = management_pb2_grpc.ManagementAPIsServiceStub(channel)
        reply = stub.DescribeModel(
            management_pb2.DescribeModelRequest(model_name="probe"), timeout=30,
            metadata=(("authorization", f"Bearer {served.keys['management']}"),))
    over_grpc = json.loads(reply.msg)[0]
    assert {key: over_grpc[key] for key in expected} == expected
    # The streamer's archive sets none of them: TorchServe's values for a model without.
    plain = requests.get(f"{server.management}/models/streamer", timeout=30,
                         headers=served.auth("management")).json()[0]
    assert (plain["parallelType"], plain["parallelLevel"], plain["continuousBatching"]) == \
        ("", 0, False)


def test_the_log_says_what_torchserve_keys_and_flags_do_here(served: Served) -> None:
    log = served.server.log_text()
    for key in ("vmargs", "netty_client_threads", "async_logging"):
        assert len(re.findall(rf"config: {key} has no effect here: \S", log)) == 1, key
    for flag in ("--plugins-path", "--async", "--sock-type"):
        assert len(re.findall(rf"{flag} has no effect here: \S", log)) == 1, flag
    for key in ("parallelType", "torchrun", "deviceType", "continuousBatching",
                "asyncCommunication", "useJobTicket"):
        assert re.search(rf"model probe version 1\.0: model-config\.yaml {key}=.*: "
                         r"(honoured|not applied)", log), key
    assert "unknown key" not in log


def test_device_type_cpu_keeps_a_model_off_the_gpus(build_mar, start_server, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """model-config.yaml ``deviceType: cpu`` on a server with GPUs (simulated): its workers
    get no GPU, and describe says cpu; ``deviceType: gpu`` and no key take the GPUs."""
    monkeypatch.setenv("BATCHSERVE_TEST_PROBE_DIR", str(tmp_path))
    for device in ("cpu", "gpu"):
        config_file = tmp_path / f"{device}.yaml"
        config_file.write_text(f"deviceType: {device}\n")
        build_mar(f"on_{device}", "gpu_probe", config_file=config_file)
    build_mar("unsaid", "gpu_probe")
    server = start_server("on_cpu.mar", "on_gpu.mar", "unsaid.mar", visible_gpus=2)
    seen = {}
    for name in ("on_cpu", "on_gpu", "unsaid"):
        described = server.describe(name)
        worker = described["workers"][0]  # type: ignore[index]
        seen[name] = (described["deviceType"], worker["gpu"], server.predict(name, b"x").text)
    assert seen["on_cpu"] == ("cpu", False, "None")
    assert seen["on_gpu"][:2] == seen["unsaid"][:2] == ("gpu", True)
    assert {seen["on_gpu"][2], seen["unsaid"][2]} == {"0", "1"}
