"""The management API end to end: versions, scaling real processes, tokens, snapshots."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import requests

from tests.conftest import RunningServer, spawn_server


def _models(server: RunningServer) -> str:
    return f"{server.management}/models"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _worker_pids(server: RunningServer, name: str) -> list[int]:
    return [w["pid"] for w in server.describe(name)["workers"]]  # type: ignore[union-attr]


def _register(server: RunningServer, **params: object) -> requests.Response:
    return requests.post(_models(server), params={"synchronous": "true", **params}, timeout=120)


def test_list_is_sorted_and_paginated(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server()
    for name in ("e", "c", "a", "d", "b"):
        assert _register(server, url="echo.mar", model_name=name,
                         initial_workers=0).status_code == 200
    first = requests.get(_models(server), params={"limit": 2}, timeout=10).json()
    assert first == {"nextPageToken": "2", "models": [
        {"modelName": "a", "modelUrl": "echo.mar"}, {"modelName": "b", "modelUrl": "echo.mar"}]}
    second = requests.get(_models(server), params={"limit": 2, "next_page_token": 2},
                          timeout=10).json()
    assert [m["modelName"] for m in second["models"]] == ["c", "d"]
    last = requests.get(_models(server), params={"limit": 2, "next_page_token": 4},
                        timeout=10).json()
    assert last == {"models": [{"modelName": "e", "modelUrl": "echo.mar"}]}
    everything = requests.get(_models(server), params={"limit": 500}, timeout=10).json()
    assert len(everything["models"]) == 5 and "nextPageToken" not in everything
    zero_workers = requests.post(_models(server), params={"url": "echo.mar", "model_name": "z",
                                                          "initial_workers": 0}, timeout=30)
    assert "Use scale workers API" in zero_workers.json()["status"]
    assert requests.get(_models(server), params={"limit": "x"}, timeout=10).status_code == 400


def test_versions_side_by_side_default_and_removal(build_mar, model_store: Path,
                                                   start_server) -> None:
    build_mar("multi", "describable", version="1.0").rename(model_store / "multi-1.mar")
    build_mar("multi", "describable", version="2.0").rename(model_store / "multi-2.mar")
    server = start_server()
    assert _register(server, url="multi-1.mar").status_code == 200
    assert _register(server, url="multi-2.mar").status_code == 200

    def predict(path: str) -> str:
        return requests.post(f"{server.inference}/predictions/{path}", data=b"x",
                             timeout=30).text

    assert predict("multi") == "version 1.0"
    assert predict("multi/1.0") == "version 1.0"
    assert predict("multi/2.0") == "version 2.0"
    assert requests.post(f"{server.inference}/predictions/multi/3.0", data=b"x",
                         timeout=30).status_code == 404

    all_versions = requests.get(f"{_models(server)}/multi/all", timeout=10).json()
    assert sorted(d["modelVersion"] for d in all_versions) == ["1.0", "2.0"]

    changed = requests.put(f"{_models(server)}/multi/2.0/set-default", timeout=10)
    assert changed.status_code == 200
    assert changed.json() == {
        "status": 'Default version successfully updated for model "multi" to "2.0"'}
    assert predict("multi") == "version 2.0"
    assert requests.put(f"{_models(server)}/multi/9.9/set-default",
                        timeout=10).status_code == 404

    refused = requests.delete(f"{_models(server)}/multi/2.0", timeout=30)
    assert refused.status_code == 403
    assert "default version" in refused.json()["message"]
    pids_v1 = _worker_pids(server, "multi/1.0")
    assert requests.delete(f"{_models(server)}/multi/1.0", timeout=60).status_code == 200
    assert predict("multi") == "version 2.0"
    for pid in pids_v1:
        server.wait_for(lambda pid=pid: not _alive(pid), f"worker {pid} to exit")

    customized = requests.get(f"{_models(server)}/multi", params={"customized": "true"},
                              timeout=30).json()[0]
    assert customized["customizedMetadata"] == {"data1": "1", "version": "2.0"}


def test_scaling_starts_and_stops_real_processes(build_mar, start_server,
                                                 tmp_path: Path) -> None:
    build_mar("gate", "gate")
    server = start_server("gate.mar")
    [first] = _worker_pids(server, "gate")

    up = requests.put(f"{_models(server)}/gate",
                      params={"min_worker": 3, "max_worker": 3, "synchronous": "true"},
                      timeout=60)
    assert up.json() == {"status": "Workers scaled to 3 for model: gate"}
    pids = _worker_pids(server, "gate")
    assert len(set(pids)) == 3 and all(_alive(p) for p in pids)
    # Fresh (`python -m backend`) or forked by the fork server
    # (`python -m backend.process.forkserver`).
    assert all({"backend", "backend.process.forkserver"} & set(psutil.Process(p).cmdline())
               for p in pids)
    described = server.describe("gate")
    assert (described["minWorkers"], described["maxWorkers"]) == (3, 3)

    down = requests.put(f"{_models(server)}/gate", params={"min_worker": 1}, timeout=60)
    assert down.status_code == 202
    for pid in pids[1:]:
        server.wait_for(lambda pid=pid: not _alive(pid), f"worker {pid} to stop")
    assert _worker_pids(server, "gate") == [first]

    bad = requests.put(f"{_models(server)}/gate", params={"min_worker": 3, "max_worker": 1},
                       timeout=10)
    assert bad.status_code == 400
    assert "max_worker cannot be less than min_worker" in bad.json()["message"]


def test_scaling_down_with_timeout_0_kills_a_busy_worker_at_once(
        build_mar, start_server, tmp_path: Path) -> None:
    build_mar("gate", "gate")
    server = start_server("gate.mar")
    [pid] = _worker_pids(server, "gate")
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(server.predict, "gate", str(tmp_path / "never").encode())
        server.wait_for(lambda: server.describe("gate")["batching"]["inFlightBatches"] == 1,  # type: ignore[index]
                        "the request to reach the worker")
        down = requests.put(f"{_models(server)}/gate",
                            params={"min_worker": 0, "timeout": 0, "synchronous": "true"},
                            timeout=30)
        assert down.status_code == 200
        answer = held.result(timeout=10)
    assert answer.status_code == 500
    assert "Worker died" in answer.json()["message"]
    assert not _alive(pid)


def test_token_authorization(build_mar, start_server, tmp_path: Path) -> None:
    build_mar("echo", "echo")
    key_file = tmp_path / "key_file.json"
    server = start_server("echo.mar", disable_token_authorization=False, key_file=key_file)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    keys = json.loads(key_file.read_text())
    assert set(keys) == {"inference", "management", "API"}
    assert "expiration time" in keys["inference"]

    def bearer(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    missing = server.predict("echo", b"x")
    assert missing.status_code == 401
    assert missing.json()["type"] == "InvalidKeyException"
    assert server.predict("echo", b"x", headers=bearer("wrong")).status_code == 401
    inference_key = keys["inference"]["key"]
    assert server.predict("echo", b"ok", headers=bearer(inference_key)).content == b"ok"
    assert requests.get(f"{server.inference}/ping", timeout=10).status_code == 200

    assert requests.get(_models(server), headers=bearer(inference_key),
                        timeout=10).status_code == 401
    management_key = keys["management"]["key"]
    assert requests.get(_models(server), headers=bearer(management_key),
                        timeout=10).status_code == 200

    not_api = requests.get(f"{server.management}/token", params={"type": "inference"},
                           headers=bearer(management_key), timeout=10)
    assert not_api.status_code == 401
    rotated = requests.get(f"{server.management}/token", params={"type": "inference"},
                           headers=bearer(keys["API"]["key"]), timeout=10)
    assert rotated.status_code == 200
    new_key = rotated.json()["inference"]["key"]
    assert new_key != inference_key
    assert json.loads(key_file.read_text())["inference"]["key"] == new_key
    assert server.predict("echo", b"x", headers=bearer(inference_key)).status_code == 401
    assert server.predict("echo", b"new", headers=bearer(new_key)).content == b"new"

    server.stop()
    assert not key_file.exists()


def test_snapshot_is_written_and_restored(build_mar, start_server, tmp_path: Path) -> None:
    build_mar("echo", "echo")
    logs = tmp_path / "snap-logs"
    first = start_server(log_location=logs)
    assert _register(first, url="echo.mar", model_name="kept", batch_size=4,
                     max_batch_delay=7, initial_workers=2).status_code == 200
    snapshots = sorted((logs / "config").glob("*-snapshot.cfg"))
    assert snapshots
    assert stat.S_IMODE(snapshots[-1].stat().st_mode) == 0o600
    first.stop()

    restored = start_server(log_location=logs)
    described = restored.describe("kept")
    assert (described["batchSize"], described["maxBatchDelay"]) == (4, 7)
    assert described["loadedAtStartup"] is True
    workers = described["workers"]
    assert isinstance(workers, list) and len(workers) == 2
    assert restored.predict("kept", b"back").content == b"back"
    restored.stop()

    fresh = start_server(log_location=logs, snapshot_disabled=True)
    assert requests.get(_models(fresh), timeout=10).json() == {"models": []}


def test_settings_priority_api_over_yaml_over_properties(build_mar, start_server,
                                                        tmp_path: Path) -> None:
    from frontend.config import parse_models_json

    config_file = tmp_path / "model-config.yaml"
    config_file.write_text("batchSize: 4\nmaxBatchDelay: 30\nminWorkers: 2\nresponseTimeout: 9\n")
    build_mar("tuned", "echo", config_file=config_file)
    properties = parse_models_json(
        '{"tuned": {"1.0": {"batchSize": 2, "maxBatchDelay": 5, "responseTimeout": 3, '
        '"startupTimeout": 77}}}')
    server = start_server(models=properties)

    assert _register(server, url="tuned.mar", max_batch_delay=11).status_code == 200
    described = server.describe("tuned")
    assert described["batchSize"] == 4  # YAML over properties
    assert described["maxBatchDelay"] == 11  # API over YAML
    assert described["responseTimeout"] == 9  # YAML over properties
    assert described["startupTimeout"] == 77  # properties over the default
    assert len(described["workers"]) == 2  # type: ignore[arg-type]


def test_both_ports_describe_themselves_with_valid_openapi(start_server) -> None:
    from openapi_spec_validator import validate

    server = start_server()
    for base, expected in ((server.inference, "/predictions/{model_name}"),
                           (server.management, "/models")):
        described = requests.get(f"{base}/api-description", timeout=10)
        assert described.status_code == 200
        document = described.json()
        validate(document)
        assert expected in document["paths"]
        assert requests.options(f"{base}/", timeout=10).json() == document


def test_allowed_urls_gate_downloads_and_paths(build_mar, model_store: Path, start_server,
                                              tmp_path: Path) -> None:
    import functools
    import http.server
    import threading

    build_mar("echo", "echo")
    outside = tmp_path / "outside"
    outside.mkdir()
    (model_store / "echo.mar").rename(outside / "remote.mar")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(outside))
    handler.log_message = lambda *args: None  # type: ignore[method-assign]
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        closed = start_server()
        refused = _register(closed, url=f"{base}/remote.mar")
        assert refused.status_code == 403
        assert "allowed_urls" in refused.json()["message"]
        assert _register(closed, url=str(outside / "remote.mar")).status_code == 403
        assert not (model_store / "remote.mar").exists()
        # A path inside the model store is the store's, as its bare name is; a link there to
        # a file outside is not.
        (model_store / "nested").mkdir()
        (model_store / "nested" / "inside.mar").hardlink_to(outside / "remote.mar")
        (model_store / "nested" / "link.mar").symlink_to(outside / "remote.mar")
        inside = _register(closed, url=str(model_store / "nested" / "inside.mar"),
                           model_name="inside")
        assert inside.status_code == 200, inside.text
        assert closed.predict("inside", b"in the store").content == b"in the store"
        linked = _register(closed, url=str(model_store / "nested" / "link.mar"),
                           model_name="linked")
        assert linked.status_code == 403, linked.text

        pattern = f"http://127\\.0\\.0\\.1:{httpd.server_address[1]}/.*"
        opened = start_server(allowed_urls=(pattern, f"{outside}/.*"))
        fetched = _register(opened, url=f"{base}/remote.mar", model_name="fetched")
        assert fetched.status_code == 200, fetched.text
        assert (model_store / "remote.mar").exists()
        assert opened.describe("fetched")["modelUrl"] == "remote.mar"
        assert opened.predict("fetched", b"over http").content == b"over http"
        again = _register(opened, url=f"{base}/remote.mar", model_name="twice")
        assert again.status_code == 409
        by_path = _register(opened, url=str(outside / "remote.mar"), model_name="by_path")
        assert by_path.status_code == 200, by_path.text
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_allowed_urls_cannot_be_escaped_with_dot_segments(build_mar, model_store: Path,
                                                          start_server, tmp_path: Path) -> None:
    import functools
    import http.server
    import threading

    build_mar("echo", "echo")
    served = tmp_path / "served"
    (served / "ok").mkdir(parents=True)
    (served / "secret").mkdir()
    (model_store / "echo.mar").rename(served / "secret" / "s1.mar")
    (served / "ok" / "junk.mar").write_bytes(b"not an archive")
    fetched: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            fetched.append(self.path)
            if self.path == "/ok/redirect.mar":
                self.send_response(302)
                self.send_header("Location", "/ok/%2e%2e/secret/s1.mar")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            super().do_GET()

    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(served)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    port = httpd.server_address[1]
    base = f"http://127.0.0.1:{port}"
    try:
        server = start_server(allowed_urls=(rf"http://127\.0\.0\.1:{port}/ok/.*",))
        for path in ("/ok/../secret/s1.mar", "/ok/%2e%2e/secret/s1.mar",
                     "/ok/./../secret/s1.mar", "/ok/%2E%2E%2Fsecret/s1.mar",
                     "/ok/redirect.mar"):
            refused = _register(server, url=f"{base}{path}", model_name="escaped")
            assert refused.status_code == 403, (path, refused.text)
            assert "'..' segment" in refused.json()["message"]
        assert fetched == ["/ok/redirect.mar"]  # the secret was never requested
        # A download whose registration then fails leaves nothing in the store either.
        junk = _register(server, url=f"{base}/ok/junk.mar")
        assert junk.status_code == 400, junk.text
        assert sorted(p.name for p in model_store.iterdir()) == []
        assert requests.get(_models(server), timeout=10).json() == {"models": []}
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_unregister_drains_in_flight_requests(build_mar, start_server, tmp_path: Path) -> None:
    build_mar("gate", "gate")
    server = start_server("gate.mar")
    gate = tmp_path / "open"
    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(server.predict, "gate", str(gate).encode())
        server.wait_for(lambda: server.describe("gate")["batching"]["inFlightBatches"] == 1,  # type: ignore[index]
                        "the request to reach the worker")
        deleting = pool.submit(requests.delete, f"{_models(server)}/gate", timeout=60)
        server.wait_for(
            lambda: requests.get(_models(server), timeout=10).json() == {"models": []},
            "the model to leave the registry")
        assert server.predict("gate", b"late").status_code == 404
        assert not deleting.done()
        gate.touch()
        assert held.result(timeout=30).status_code == 200
        assert deleting.result(timeout=30).status_code == 200


def test_asynchronous_registration_answers_202_then_comes_up(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server()
    accepted = requests.post(_models(server), params={"url": "echo.mar",
                                                      "synchronous": "false"}, timeout=30)
    assert accepted.status_code == 202
    assert "Processing worker updates" in accepted.json()["status"]
    server.wait_for(lambda: server.describe("echo")["workers"][0]["status"] == "READY",  # type: ignore[index]
                    "the worker to load the model")
    assert server.predict("echo", b"up").content == b"up"


def test_mlserver_and_kserve_batch_setting_names(build_mar, start_server,
                                                 tmp_path: Path) -> None:
    config_file = tmp_path / "model-config.yaml"
    config_file.write_text("maxBatchSize: 6\nmaxLatency: 40\n")  # KServe's batcher names
    build_mar("kserve_named", "echo", config_file=config_file)
    build_mar("echo", "echo")
    server = start_server()
    assert _register(server, url="kserve_named.mar", initial_workers=0).status_code == 200
    described = server.describe("kserve_named")
    assert (described["batchSize"], described["maxBatchDelay"]) == (6, 40)
    # MLServer's names as register parameters: max_batch_time is in seconds.
    assert _register(server, url="echo.mar", max_batch_size=5, max_batch_time=0.02,
                     initial_workers=0).status_code == 200
    described = server.describe("echo")
    assert (described["batchSize"], described["maxBatchDelay"]) == (5, 20)
    clash = _register(server, url="echo.mar", model_name="clash", max_batch_size=5,
                      maxBatchSize=6)
    assert clash.status_code == 400


def test_registration_starts_default_workers_per_model_or_none(build_mar, start_server) -> None:
    """TorchServe's rule: a model registered through the API without initial_workers gets
    default_workers_per_model when it is set, else no worker until scaled; a model loaded at
    start-up gets one per CPU core without the key. The same for a JSON body."""
    build_mar("echo", "echo")
    server = start_server("echo.mar", default_workers_per_model=0)
    assert len(server.describe("echo")["workers"]) >= 1  # type: ignore[arg-type]
    registered = _register(server, url="echo.mar", model_name="later")
    assert registered.status_code == 200
    assert registered.json() == {"status": 'Model "later" Version: 1.0 registered with 0 '
                                 "initial workers. Use scale workers API to add workers for "
                                 "the model."}
    assert server.describe("later")["workers"] == []
    # Asynchronous, with no worker to start: nothing runs in the background, so 200.
    nothing = requests.post(_models(server), timeout=60, params={
        "url": "echo.mar", "model_name": "async0", "synchronous": "false"})
    assert nothing.status_code == 200 and "0 initial workers" in nothing.json()["status"]
    configured = start_server(default_workers_per_model=2)
    two = _register(configured, url="echo.mar", model_name="two")
    assert two.json()["status"].endswith("registered with 2 initial workers"), two.text
    assert len(configured.describe("two")["workers"]) == 2  # type: ignore[arg-type]
    # A JSON body, as SageMaker's agent registers a multi-model endpoint's models: the same
    # rule (TorchServe reads the body instead of the query; synchronous by default).
    sagemaker = requests.post(_models(configured), timeout=120, params={"url": "ignored.mar"},
                              json={"model_name": "json", "url": "echo.mar"})
    assert sagemaker.status_code == 200, sagemaker.text
    assert sagemaker.json()["status"].endswith("registered with 2 initial workers")
    assert len(configured.describe("json")["workers"]) == 2  # type: ignore[arg-type]
    for bad in (b"[1]", b"{not json", b'{"url": ["echo.mar"]}'):
        refused = requests.post(_models(configured), data=bad, timeout=30,
                                headers={"Content-Type": "application/json"})
        assert refused.status_code == 400, (bad, refused.text)


def test_an_invalid_handler_registers_and_scaling_it_up_fails(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server(default_workers_per_model=0)
    registered = _register(server, url="echo.mar", handler="no_such_module")
    assert registered.status_code == 200, registered.text
    scaled = requests.put(f"{_models(server)}/echo",
                          params={"min_worker": "1", "synchronous": "true"}, timeout=120)
    assert scaled.status_code == 500
    body = scaled.json()
    assert body["type"] == "InternalServerException"
    assert body["message"].startswith("Failed to start workers")
    assert "no_such_module" in body["message"]
    # Asynchronous: 202 at once, and a prediction then fails promptly, not at its timeout.
    assert requests.put(f"{_models(server)}/echo", params={"min_worker": "1"},
                        timeout=30).status_code == 202
    answered = server.predict("echo", b"x", headers={"X-Request-Timeout": "60"})
    assert answered.status_code in (500, 503), answered.text


def test_describe_has_torchserve_012_fields(build_mar, start_server, tmp_path: Path) -> None:
    config = tmp_path / "model-config.yaml"
    config.write_text("clientTimeoutInMills: 2500\nmaxRetryTimeoutInSec: 60\n")
    build_mar("echo", "echo", config_file=config)
    server = start_server("echo.mar")
    described = server.describe("echo")
    expected = {"maxRetryTimeoutInSec": 60, "clientTimeoutInMills": 2500, "parallelType": "",
                "parallelLevel": 0, "deviceType": "cpu", "continuousBatching": False,
                "useJobTicket": False}
    assert {key: described[key] for key in expected} == expected
    worker = described["workers"][0]  # type: ignore[index]
    assert worker["gpu"] is False and worker["gpuUsage"] == "N/A"


def test_a_name_or_version_no_route_can_carry_is_refused_at_registration(
        build_mar, start_server) -> None:
    build_mar("echo", "echo")
    longest_version = "v" + "1" * 63
    build_mar("versioned", "echo", version=longest_version)
    # (Our archiver refuses such a version: an archive made elsewhere may carry one.)
    for folder_name, key, value in (("badversion", "modelVersion", "con.v2"),
                                    ("longname", "modelName", "x" * 10_000)):
        manifest = build_mar(folder_name, "echo", fmt="no-archive") / "MAR-INF" / "MANIFEST.json"
        document = json.loads(manifest.read_text())
        document["model"][key] = value
        manifest.write_text(json.dumps(document))
    server = start_server()
    for name, rule in (("x" * 256, "at most 128 characters"), ("x" * 129, "at most 128"),
                       ("CON", "device name"), ("nul.v2", "device name"),
                       ("com1", "device name"), ("ends.", "end with '.'"),
                       ("_first", "beginning with a letter or a digit"),
                       ("a%2Fb", "use letters, digits"), ("a b", "use letters, digits")):
        refused = _register(server, url="echo.mar", model_name=name)
        assert refused.status_code == 400, (name[:20], refused.text)
        assert rule in refused.json()["message"], (name[:20], refused.text)
        assert len(refused.text) < 500  # the name is not echoed whole
    for url, rule in (("badversion", "invalid model version"),
                      ("longname", "at most 128 characters (10000 given)")):
        refused = _register(server, url=url)
        assert refused.status_code == 400 and rule in refused.json()["message"], refused.text
    assert requests.get(_models(server), timeout=30).json()["models"] == []

    # The longest name and version are usable on every route.
    longest_name = "n" * 128
    assert _register(server, url="echo.mar", model_name=longest_name).status_code == 200
    assert _register(server, url="versioned.mar", model_name="v").status_code == 200
    assert server.predict(longest_name, b"hi").content == b"hi"
    assert server.predict(f"v/{longest_version}", b"hi").content == b"hi"
    v1 = requests.post(f"{server.inference}/v1/models/{longest_name}:predict",
                       json={"instances": [1]}, timeout=30)
    assert v1.status_code == 200, v1.text
    ready = requests.get(f"{server.inference}/v2/models/v/versions/{longest_version}/ready",
                         timeout=30)
    assert ready.status_code == 200, ready.text
    assert requests.delete(f"{_models(server)}/{longest_name}", timeout=30).status_code == 200


def test_a_bad_newest_snapshot_is_skipped_and_the_server_starts_from_the_next(
        build_mar, model_store: Path, tmp_path: Path) -> None:
    """``torchserve --start`` with a snapshot folder whose newest files are not snapshots:
    one line each, then the models of the newest readable one."""
    build_mar("echo", "echo")
    work = tmp_path / "work"
    folder = work / "logs" / "config"
    folder.mkdir(parents=True)
    good = {"name": "snapshot", "modelCount": 1, "models": {"kept": {"1.0": {
        "defaultVersion": True, "marName": "echo.mar", "minWorkers": 1, "maxWorkers": 1,
        "batchSize": 3}}}}
    (folder / "20260101000000000-snapshot.cfg").write_text(
        "model_snapshot=" + json.dumps(good) + "\n")
    bad = {"20260101000000001": b"\xff\xfe\x00not utf-8",
           "20260101000000002": b'model_snapshot={"models": []}\n',
           "20260101000000003": b'model_snapshot={"models": {"kept": {"1.0": "echo.mar"}}}\n',
           "20260101000000004": b'model_snapshot={"models": {"kept": {"1.0": {}}}}\n'}
    for stamp, text in bad.items():
        (folder / f"{stamp}-snapshot.cfg").write_bytes(text)
    server = spawn_server(work, model_store)
    try:
        assert requests.post(f"{server.inference}/predictions/kept", data=b"back",
                             timeout=30).content == b"back"
        described = requests.get(f"{server.management}/models/kept", timeout=30).json()[0]
        assert described["batchSize"] == 3
        log = server.log_text()
        skipped = [line for line in log.splitlines() if "skipping unreadable snapshot" in line]
        assert len(skipped) == len(bad), log
        assert all(any(stamp in line for line in skipped) for stamp in bad)
        assert "Traceback" not in log
    finally:
        server.stop()


def test_a_malformed_model_snapshot_key_is_a_configuration_error(
        model_store: Path, tmp_path: Path) -> None:
    """KServe restores models with model_snapshot in config.properties: a malformed one stops
    the start with one line naming the key (exit 2), with or without --ncs, in the foreground
    or not."""
    env = {**os.environ, "BATCHSERVE_STATE_DIR": str(tmp_path / "state")}
    for snapshot, problem in (('{"models": []}', "'models' must be an object"),
                              ('{"models": {"m": {"1.0": "m.mar"}}}', "models.m.1.0 must be"),
                              ('{"models": {"m": {"1.0": {}}}}', "models.m.1.0.marName"),
                              ('{"models": {', "model_snapshot=")):
        config = tmp_path / "config.properties"
        config.write_text(f"model_snapshot={snapshot}\n")
        for flags in (["--ncs"], ["--ncs", "--foreground"], []):
            result = subprocess.run(
                [str(Path(sys.executable).parent / "torchserve"), "--start", "--model-store",
                 str(model_store), "--ts-config", str(config), *flags],
                env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                stdin=subprocess.DEVNULL)
            assert result.returncode == 2, (snapshot, flags, result.stdout, result.stderr)
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
            assert "model_snapshot" in lines[0] and problem in lines[0], lines[0]
