"""The path of a request through the real server: HTTP -> queue -> batch -> worker process."""

from __future__ import annotations

import collections
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import requests


def _error_body(response: requests.Response) -> dict[str, object]:
    body = response.json()
    assert set(body) == {"code", "type", "message"}
    assert body["code"] == response.status_code
    return body  # type: ignore[no-any-return]


def test_echo_answers_raw_json_and_multipart_bodies(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar")

    raw = server.predict("echo", b"\x00\x01binary\xff")
    assert raw.status_code == 200
    assert raw.content == b"\x00\x01binary\xff"
    assert raw.headers["x-request-id"]

    as_json = server.predict("echo", b'{"a": [1, 2]}', headers={"content-type": "application/json"})
    assert as_json.status_code == 200
    assert as_json.json() == {"a": [1, 2]}

    form = requests.post(f"{server.inference}/predictions/echo",
                         files={"data": ("k.jpg", b"JPEGBYTES", "image/jpeg")}, timeout=30)
    assert form.status_code == 200
    assert form.content == b"JPEGBYTES"

    versioned = requests.put(f"{server.inference}/predictions/echo/1.0", data=b"v", timeout=30)
    assert versioned.status_code == 200 and versioned.content == b"v"

    # No cors_allowed_* key set: no CORS header on any port, and a preflight is no request
    # of its own (tests/integration/test_cors_and_legacy.py has them set).
    origin = {"Origin": "http://elsewhere.example"}
    answers = [server.predict("echo", b"x", headers=origin),
               requests.get(f"{server.management}/models", headers=origin, timeout=30),
               requests.get(f"{server.metrics}/metrics", headers=origin, timeout=30),
               requests.options(f"{server.inference}/predictions/echo", timeout=30,
                                headers={**origin, "Access-Control-Request-Method": "POST"})]
    assert [a.status_code for a in answers] == [200, 200, 200, 405]
    assert not [name for a in answers for name in a.headers
                if name.lower().startswith("access-control-")]


def test_batches_are_formed_and_never_exceed_batch_size(build_mar, start_server) -> None:
    build_mar("batch_len", "batch_len")
    server = start_server()
    registered = requests.post(
        f"{server.management}/models",
        params={"url": "batch_len.mar", "batch_size": 8, "max_batch_delay": 2000,
                "batch_policy": "fixed",
                "initial_workers": 1, "synchronous": "true"}, timeout=60)
    assert registered.status_code == 200, registered.text

    with ThreadPoolExecutor(32) as pool:
        responses = list(pool.map(lambda _: server.predict("batch_len", b"x"), range(32)))

    assert all(r.status_code == 200 for r in responses)
    sizes = [int(r.text) for r in responses]
    assert max(sizes) > 1, sizes
    assert max(sizes) <= 8, sizes
    # Each batch of k requests answers k requests with "k": the counts must add up.
    for size, count in collections.Counter(sizes).items():
        assert count % size == 0, sizes
    described = server.describe("batch_len")
    assert described["batchSize"] == 8
    assert max(described["batching"]["recentBatchSizes"]) <= 8  # type: ignore[index]


def test_every_concurrent_request_gets_its_own_answer(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server()
    requests.post(f"{server.management}/models",
                  params={"url": "echo.mar", "batch_size": 4, "max_batch_delay": 20,
                          "initial_workers": 2}, timeout=60).raise_for_status()
    payloads = [f"payload-{i}-{'x' * (i % 7)}".encode() for i in range(200)]

    with ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(lambda p: server.predict("echo", p), payloads))

    assert [a.status_code for a in answers] == [200] * len(payloads)
    assert [a.content for a in answers] == payloads
    assert len({a.headers["x-request-id"] for a in answers}) == len(payloads)


def test_unknown_model_and_path_are_404_with_torchserve_error_body(start_server) -> None:
    server = start_server()
    missing = server.predict("nope", b"x")
    assert missing.status_code == 404
    body = _error_body(missing)
    assert body["type"] == "ModelNotFoundException"
    assert "nope" in str(body["message"])

    bad_path = requests.get(f"{server.inference}/nowhere", timeout=10)
    assert bad_path.status_code == 404
    _error_body(bad_path)

    wrong_method = requests.get(f"{server.inference}/predictions/nope", timeout=10)
    assert wrong_method.status_code == 405
    _error_body(wrong_method)


def test_full_queue_answers_503_at_once_and_queued_requests_complete(
        build_mar, start_server, tmp_path: Path) -> None:
    build_mar("gate", "gate")
    server = start_server("gate.mar", job_queue_size=1)
    first_gate, second_gate = tmp_path / "open-1", tmp_path / "open-2"

    def in_flight() -> int:
        return int(server.describe("gate")["batching"]["inFlightBatches"])  # type: ignore[index]

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(server.predict, "gate", str(first_gate).encode())
        server.wait_for(lambda: in_flight() == 1, "the first request to reach the worker")
        second = pool.submit(server.predict, "gate", str(second_gate).encode())
        server.wait_for(
            lambda: server.describe("gate")["jobQueueStatus"]["pendingRequests"] == 1,  # type: ignore[index]
            "the second request to wait in the queue")

        rejected = server.predict("gate", b"/nonexistent")
        assert rejected.status_code == 503
        assert rejected.headers["retry-after"] == "1"
        assert "queue is full" in str(_error_body(rejected)["message"])

        first_gate.touch()
        second_gate.touch()
        assert first.result(timeout=30).status_code == 200
        assert second.result(timeout=30).content == str(second_gate).encode()


def test_handler_errors_are_500_with_the_reason_and_the_worker_keeps_serving(
        build_mar, start_server) -> None:
    build_mar("raises", "raises")
    build_mar("wrong_length", "wrong_length")
    build_mar("echo", "echo")
    server = start_server("raises.mar", "wrong_length.mar", "echo.mar")

    boom = server.predict("raises", b"anything")
    assert boom.status_code == 500
    assert "RuntimeError: boom" in str(_error_body(boom)["message"])
    assert "Traceback" not in boom.text

    invalid = server.predict("raises", b"invalid")
    assert invalid.status_code == 400
    assert "not a picture of a cat" in str(_error_body(invalid)["message"])

    mismatch = server.predict("wrong_length", b"x")
    assert mismatch.status_code == 500
    assert "returned" in str(_error_body(mismatch)["message"])

    pid = server.describe("raises")["workers"][0]["pid"]  # type: ignore[index]
    again = server.predict("raises", b"again")
    assert again.status_code == 500
    assert server.describe("raises")["workers"][0]["pid"] == pid  # type: ignore[index]
    assert server.predict("echo", b"still up").content == b"still up"


def test_register_describe_list_scale_unregister(build_mar, start_server) -> None:
    build_mar("echo", "echo", version="2.0")
    server = start_server()
    models = f"{server.management}/models"

    missing_url = requests.post(models, timeout=10)
    assert missing_url.status_code == 400
    _error_body(missing_url)

    registered = requests.post(models, params={
        "url": "echo.mar", "model_name": "mine", "batch_size": 8, "max_batch_delay": 50,
        "initial_workers": 1, "synchronous": "true"}, timeout=60)
    assert registered.status_code == 200
    assert registered.json() == {
        "status": 'Model "mine" Version: 2.0 registered with 1 initial workers'}

    duplicate = requests.post(models, params={"url": "echo.mar", "model_name": "mine"},
                              timeout=60)
    assert duplicate.status_code == 409

    assert server.predict("mine", b"hello").content == b"hello"
    listed = requests.get(models, timeout=10).json()
    assert listed == {"models": [{"modelName": "mine", "modelUrl": "echo.mar"}]}

    described = server.describe("mine")
    assert (described["modelName"], described["modelVersion"]) == ("mine", "2.0")
    assert (described["batchSize"], described["maxBatchDelay"]) == (8, 50)
    workers = described["workers"]
    assert isinstance(workers, list) and len(workers) == 1
    assert workers[0]["status"] == "READY"
    old_pid = workers[0]["pid"]
    assert psutil.pid_exists(old_pid)

    scaled = requests.put(f"{models}/mine", params={"min_worker": 2, "synchronous": "true"},
                          timeout=60)
    assert scaled.status_code == 200, scaled.text
    pids = [w["pid"] for w in server.describe("mine")["workers"]]  # type: ignore[union-attr]
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)

    removed = requests.delete(f"{models}/mine", timeout=60)
    assert removed.status_code == 200
    assert server.predict("mine", b"x").status_code == 404
    for pid in pids:
        server.wait_for(lambda pid=pid: not _alive(pid), f"worker {pid} to exit")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_model_api_is_off_unless_enabled(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar", enable_model_api=False)
    refused = requests.post(f"{server.management}/models", params={"url": "echo.mar"},
                            timeout=10)
    assert refused.status_code == 405
    assert "--enable-model-api" in str(_error_body(refused)["message"])
    assert requests.delete(f"{server.management}/models/echo", timeout=10).status_code == 405
    assert server.predict("echo", b"ok").content == b"ok"


def test_tgz_and_folder_archives_are_served(build_mar, start_server) -> None:
    build_mar("as_tgz", "echo", fmt="tgz")
    build_mar("as_folder", "echo", fmt="no-archive")
    server = start_server("as_tgz.tar.gz", "as_folder")
    assert server.predict("as_tgz", b"t").content == b"t"
    assert server.predict("as_folder", b"f").content == b"f"


def test_broken_registration_leaves_nothing_behind(build_mar, model_store: Path,
                                                  start_server) -> None:
    (model_store / "broken.mar").write_bytes(b"not a zip")
    build_mar("bad_handler", "echo:no_such_function")
    server = start_server()
    models = f"{server.management}/models"

    broken = requests.post(models, params={"url": "broken.mar"}, timeout=30)
    assert broken.status_code == 400
    assert "not a valid .mar" in str(_error_body(broken)["message"])

    failing = requests.post(models, params={"url": "bad_handler.mar", "synchronous": "true"},
                            timeout=60)
    assert failing.status_code == 500
    assert "no_such_function" in str(_error_body(failing)["message"])
    assert requests.get(models, timeout=10).json() == {"models": []}

    escaping = requests.post(models, params={"url": "/etc/passwd"}, timeout=10)
    assert escaping.status_code == 403


def test_metrics_endpoint_counts_requests(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar")
    for _ in range(3):
        server.predict("echo", b"m")
    text = requests.get(f"{server.metrics}/metrics", timeout=10).text
    line = next(x for x in text.splitlines()
                if x.startswith("ts_inference_requests_total{") and 'model_name="echo"' in x)
    assert float(line.rsplit(" ", 1)[1]) == 3.0
    assert json.loads(requests.get(f"{server.inference}/ping", timeout=10).text) == {
        "status": "Healthy"}


def test_stop_finishes_in_flight_requests_before_stopping_workers(
        build_mar, start_server, tmp_path: Path) -> None:
    build_mar("gate", "gate")
    server = start_server("gate.mar")
    gate = tmp_path / "open"
    worker_pid = server.describe("gate")["workers"][0]["pid"]  # type: ignore[index]

    def refused() -> bool:
        try:
            requests.get(f"{server.inference}/ping", timeout=1)
        except requests.ConnectionError:
            return True
        return False

    with ThreadPoolExecutor(2) as pool:
        pending = pool.submit(server.predict, "gate", str(gate).encode())
        server.wait_for(lambda: server.describe("gate")["batching"]["inFlightBatches"] == 1,  # type: ignore[index]
                        "the request to reach the worker")
        stopping = pool.submit(server.stop)
        server.wait_for(refused, "the listener to close")
        assert not pending.done()
        gate.touch()
        answer = pending.result(timeout=30)
        stopping.result(timeout=60)
    assert answer.status_code == 200
    assert answer.content == str(gate).encode()
    assert not _alive(worker_pid)


def test_intermediate_responses_stream_as_http_chunks(build_mar, start_server) -> None:
    build_mar("gen", "streamer")
    build_mar("tsstyle", "streamer:torchserve_style")
    server = start_server("gen.mar", "tsstyle.mar")
    for model in ("gen", "tsstyle"):
        with requests.post(f"{server.inference}/predictions/{model}", data=b"hi",
                           stream=True, timeout=30) as answer:
            assert answer.status_code == 200
            assert answer.headers.get("transfer-encoding") == "chunked"
            assert "content-length" not in answer.headers
            chunks = [c for c in answer.iter_content(chunk_size=None) if c]
        assert b"".join(chunks) == b"hi part 1\nhi part 2\nhi part 3\n", model
        assert len(chunks) >= 2, model


def test_adaptive_policy_batches_under_concurrent_load(build_mar, start_server) -> None:
    build_mar("sleepy", "sleep")
    server = start_server()
    registered = requests.post(
        f"{server.management}/models",
        params={"url": "sleepy.mar", "batch_size": 8, "max_batch_delay": 50,
                "initial_workers": 1, "synchronous": "true"}, timeout=60)
    assert registered.status_code == 200, registered.text
    assert server.describe("sleepy")["batching"]["policy"] == "adaptive"  # type: ignore[index]

    with ThreadPoolExecutor(32) as pool:  # each batch sleeps 20 ms: the queue fills meanwhile
        answers = list(pool.map(lambda _: server.predict("sleepy", b"0.02"), range(64)))

    assert all(a.status_code == 200 for a in answers)
    sizes = server.describe("sleepy")["batching"]["recentBatchSizes"]  # type: ignore[index]
    assert sum(sizes) == 64 and max(sizes) > 1 and max(sizes) <= 8, sizes
