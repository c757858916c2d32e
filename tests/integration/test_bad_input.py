"""Bad input against the real server: each gets a clear 4xx and the server stays healthy.

Every refusal carries TorchServe's error body ``{"code", "type", "message"}``; after it the
server still answers ``/ping`` with 200 and still serves a normal request. Known bugs are
``xfail(strict=True)`` with the cause in ``reason`` until fixed.
"""

from __future__ import annotations

import io
import json
import os
import select
import socket
import stat
import tarfile
import time
import uuid
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import grpc
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos import inference_pb2, inference_pb2_grpc
from tests.conftest import RunningServer

LIMIT = 1024  # max_request_size for these tests
ANSWER_WITHIN_S = 10.0


def _error(response: requests.Response, status: int, type_name: str | None = None) -> str:
    """Check TorchServe's error body; return its message."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"code", "type", "message"}, body
    assert body["code"] == status
    assert body["message"]
    if type_name is not None:
        assert body["type"] == type_name, body
    assert "Traceback" not in response.text
    return str(body["message"])


def _assert_healthy(server: RunningServer, model: str = "echo") -> None:
    ping = requests.get(f"{server.inference}/ping", timeout=10)
    assert ping.status_code == 200 and ping.json() == {"status": "Healthy"}
    payload = f"still-serving-{uuid.uuid4()}".encode()
    answer = server.predict(model, payload)
    assert answer.status_code == 200 and answer.content == payload


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _read_response(sock: socket.socket, timeout_s: float = ANSWER_WITHIN_S) -> bytes:
    """Read until a whole HTTP response (head + Content-Length body) has arrived."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _raw_error(raw: bytes, status: int) -> dict[str, object]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), raw[:200]
    document = json.loads(body)
    assert set(document) == {"code", "type", "message"} and document["code"] == status
    return document  # type: ignore[no-any-return]


# ---- size limits --------------------------------------------------------------------------

def test_an_oversized_body_is_413_and_the_server_stays_healthy(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar", max_request_size_bytes=LIMIT)

    announced = server.predict("echo", b"x" * (LIMIT + 1))
    assert "max_request_size" in _error(announced, 413, "PayloadTooLargeException")

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(4):
            yield b"y" * (LIMIT // 2)

    streamed = requests.post(f"{server.inference}/predictions/echo", data=chunks(), timeout=30)
    _error(streamed, 413, "PayloadTooLargeException")

    at_limit = server.predict("echo", b"z" * LIMIT)
    assert at_limit.status_code == 200 and at_limit.content == b"z" * LIMIT
    _assert_healthy(server)


def test_a_huge_announced_body_is_refused_before_it_is_sent(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar", max_request_size_bytes=LIMIT)
    with socket.create_connection(("127.0.0.1", _port(server.inference))) as sock:
        # 100 MB announced, 3 bytes sent: the answer must not wait for the rest.
        sock.sendall(b"POST /predictions/echo HTTP/1.1\r\nHost: test\r\n"
                     b"Content-Type: application/octet-stream\r\n"
                     b"Content-Length: 100000000\r\n\r\nabc")
        started = time.monotonic()
        raw = _read_response(sock)
        assert time.monotonic() - started < ANSWER_WITHIN_S
    assert "100000000" in str(_raw_error(raw, 413)["message"])
    _assert_healthy(server)


def _chunked_request(sock: socket.socket) -> None:
    sock.sendall(b"POST /predictions/echo HTTP/1.1\r\nHost: test\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def test_an_endless_chunked_body_is_refused_once_it_passes_the_limit(
        build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar", max_request_size_bytes=LIMIT)
    with socket.create_connection(("127.0.0.1", _port(server.inference))) as sock:
        _chunked_request(sock)
        sent = 0
        # Piece by piece, never terminated by a zero-size chunk: the answer comes as soon as
        # the body passes the limit, while the client is still "sending".
        while not select.select([sock], [], [], 0.25)[0]:
            assert sent <= 16 * LIMIT, "no answer although the body is far past the limit"
            sock.sendall(_chunk(b"q" * 256))
            sent += 256
        raw = _read_response(sock)
    _raw_error(raw, 413)
    assert sent > LIMIT
    _assert_healthy(server)


def test_a_chunked_body_past_the_limit_in_its_first_piece_is_refused_at_once(
        build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar", max_request_size_bytes=LIMIT)
    with socket.create_connection(("127.0.0.1", _port(server.inference))) as sock:
        # Head and 2 KiB of chunks in one write: the first receive() sees all of it.
        sock.sendall(b"POST /predictions/echo HTTP/1.1\r\nHost: test\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + _chunk(b"q" * 512) * 4)
        raw = _read_response(sock, timeout_s=3.0)
    _raw_error(raw, 413)


def test_an_oversized_grpc_request_is_resource_exhausted(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar", max_request_size_bytes=LIMIT)
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_inference_port}") as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Predictions(inference_pb2.PredictionsRequest(
                model_name="echo", input={"body": b"x" * (LIMIT * 2)}), timeout=30)
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        fine = stub.Predictions(inference_pb2.PredictionsRequest(
            model_name="echo", input={"body": b"small"}), timeout=30)
        assert fine.prediction == b"small"
    _assert_healthy(server)


# ---- bodies and headers -------------------------------------------------------------------

MULTIPART = "multipart/form-data; boundary=XyZ"
PART = (b'--XyZ\r\nContent-Disposition: form-data; name="data"; filename="a.bin"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\nPAYLOAD\r\n")


MALFORMED_MULTIPART = [
    ("multipart/form-data", PART + b"--XyZ--\r\n", "boundary"),
    (MULTIPART, b"this is not multipart at all", "malformed multipart"),
    ("multipart/form-data; boundary=Other", PART + b"--XyZ--\r\n", "malformed multipart"),
    (MULTIPART, b"--XyZ\r\nContent-Disposition: form-data\r\n\r\nx\r\n--XyZ--\r\n", "name"),
    (MULTIPART, b"--XyZ\r\nno colon here\r\n\r\nx\r\n--XyZ--\r\n", "malformed multipart"),
]


def test_malformed_multipart_is_400(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar")
    for content_type, body, words in MALFORMED_MULTIPART:
        answer = server.predict("echo", body, headers={"content-type": content_type})
        assert words in _error(answer, 400, "BadRequestException"), (content_type, body)
    good = server.predict("echo", PART + b"--XyZ--\r\n", headers={"content-type": MULTIPART})
    assert good.status_code == 200 and good.content == b"PAYLOAD"
    _assert_healthy(server)


@pytest.mark.parametrize("body", [PART[:-4], PART], ids=["cut-mid-part", "no-closing-boundary"])
def test_truncated_multipart_is_400(build_mar, start_server, body: bytes) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar")
    answer = server.predict("echo", body, headers={"content-type": MULTIPART})
    _error(answer, 400)


def test_an_overlong_multipart_boundary_is_400(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar")
    answer = server.predict("echo", b"--", headers={
        "content-type": "multipart/form-data; boundary=" + "b" * 300})
    _error(answer, 400)


def test_invalid_json_reaches_the_handler_as_the_raw_bytes(build_mar, start_server) -> None:
    """Documented (backend/codecs/rows.py, decode_value): a body declared application/json
    that does not parse is handed to the handler as bytes, for the handler to judge; the echo
    handler sends it back unchanged. Valid JSON arrives decoded."""
    build_mar("echo", "echo")
    server = start_server("echo.mar")
    for broken in (b"{not json", b'{"a": 1', b"\xff\xfe", b""):
        answer = server.predict("echo", broken, headers={"content-type": "application/json"})
        assert answer.status_code == 200, answer.text
        assert answer.content == broken
        assert answer.headers["content-type"] == "application/octet-stream"
    undecodable = server.predict("echo", b"\xff\xfe", headers={"content-type": "text/plain"})
    assert undecodable.status_code == 200 and undecodable.content == b"\xff\xfe"
    valid = server.predict("echo", b'{"a": [1]}', headers={"content-type": "application/json"})
    assert valid.json() == {"a": [1]}
    _assert_healthy(server)


def test_a_bad_request_timeout_header_is_400(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar")
    for value in ("abc", "nan", "0", "-1", ""):
        answer = server.predict("echo", b"x", headers={"x-request-timeout": value})
        assert "x-request-timeout" in _error(answer, 400), value
    _assert_healthy(server)


# ---- unknown models and versions ----------------------------------------------------------

def test_unknown_models_and_versions_are_404_everywhere(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar")
    models = f"{server.management}/models"
    model_type, version_type = "ModelNotFoundException", "ModelVersionNotFoundException"
    checks = [
        (server.predict("nope", b"x"), model_type),
        (server.predict("nope/1.0", b"x"), model_type),
        (server.predict("echo/9.9", b"x"), version_type),
        (requests.get(f"{models}/nope", timeout=10), model_type),
        (requests.get(f"{models}/echo/9.9", timeout=10), version_type),
        (requests.put(f"{models}/nope", params={"min_worker": 1}, timeout=10), model_type),
        (requests.put(f"{models}/echo/9.9", params={"min_worker": 1}, timeout=10), version_type),
        (requests.put(f"{models}/echo/9.9/set-default", timeout=10), version_type),
        (requests.delete(f"{models}/nope", timeout=10), model_type),
        (requests.delete(f"{models}/echo/9.9", timeout=10), version_type),
    ]
    for answer, type_name in checks:
        _error(answer, 404, type_name)
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_inference_port}") as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        with pytest.raises(grpc.RpcError) as missing:
            stub.Predictions(inference_pb2.PredictionsRequest(model_name="nope"), timeout=30)
        assert missing.value.code() is grpc.StatusCode.NOT_FOUND
    _assert_healthy(server)


# ---- query parameters ---------------------------------------------------------------------

BAD_PARAMETERS: list[tuple[str, str, dict[str, object], str]] = [
    ("POST", "", {"url": "echo.mar", "model_name": "b", "batch_size": -1}, "batch_size"),
    ("POST", "", {"url": "echo.mar", "model_name": "b", "batch_size": 0}, "batch_size"),
    ("POST", "", {"url": "echo.mar", "model_name": "b", "batch_size": "1.5"}, "batch_size"),
    ("POST", "", {"url": "echo.mar", "model_name": "b", "initial_workers": "two"},
     "initial_workers"),
    ("POST", "", {"url": "echo.mar", "model_name": "b", "initial_workers": -1},
     "initial_workers"),
    ("POST", "", {"url": "echo.mar", "model_name": "b", "max_batch_delay": -5},
     "max_batch_delay"),
    ("POST", "", {"url": "echo.mar", "model_name": "b", "response_timeout": 0},
     "response_timeout"),
    ("POST", "", {"url": "echo.mar", "model_name": "b", "synchronous": "maybe"},
     "synchronous"),
    ("POST", "", {"url": "echo.mar", "model_name": "b", "batch_policy": "random"},
     "batch_policy"),
    ("POST", "", {"url": "echo.mar", "model_name": "b", "runtime": "java"}, "runtime"),
    ("POST", "", {"model_name": "b"}, "url"),
    ("PUT", "/echo", {"min_worker": 3, "max_worker": 2}, "max_worker"),
    ("PUT", "/echo", {"min_worker": -1}, "min_worker"),
    ("PUT", "/echo", {"min_worker": "many"}, "min_worker"),
    ("PUT", "/echo", {"min_worker": 1, "timeout": "soon"}, "timeout"),
    ("PUT", "/echo", {"number_gpu": -1}, "number_gpu"),
    ("PUT", "/echo", {"synchronous": "sometimes"}, "synchronous"),
    ("GET", "", {"limit": "ten"}, "limit"),
    ("GET", "", {"next_page_token": -1}, "next_page_token"),
    ("GET", "/echo", {"customized": "perhaps"}, "customized"),
]


def test_bad_query_parameters_are_400_and_change_nothing(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar")
    before = server.describe("echo")
    run_dir = server.server.services.loader.run_dir  # type: ignore[union-attr]
    extracted = set((run_dir / "models").iterdir())
    for method, path, params, words in BAD_PARAMETERS:
        answer = requests.request(method, f"{server.management}/models{path}", params=params,
                                  timeout=30)
        assert words in _error(answer, 400), (method, path, params)
    listed = requests.get(f"{server.management}/models", timeout=10).json()
    assert [m["modelName"] for m in listed["models"]] == ["echo"]
    after = server.describe("echo")
    assert (after["minWorkers"], after["maxWorkers"], len(after["workers"])) == (  # type: ignore[arg-type]
        before["minWorkers"], before["maxWorkers"], len(before["workers"]))  # type: ignore[arg-type]
    assert set((run_dir / "models").iterdir()) == extracted, "a refused register left files"
    _assert_healthy(server)


# ---- path traversal -----------------------------------------------------------------------

def _tree(root: Path) -> set[Path]:
    return {path for path in root.rglob("*") if "logs" not in path.relative_to(root).parts}


def test_path_traversal_in_model_names_and_urls_is_refused(
        build_mar, start_server, model_store: Path, tmp_path: Path) -> None:
    build_mar("echo", "echo")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.mar").write_bytes((model_store / "echo.mar").read_bytes())
    # allowed_urls admits the store itself, by path and by file:// URL, and nothing else.
    server = start_server("echo.mar", allowed_urls=(f"file://{model_store}/.*",
                                                    f"{model_store}/.*"))
    run_dir = server.server.services.loader.run_dir  # type: ignore[union-attr]
    before, run_before = _tree(tmp_path), _tree(run_dir)
    models = f"{server.management}/models"
    refused = [
        ({"url": "echo.mar", "model_name": "../x"}, 400),
        ({"url": "echo.mar", "model_name": "..%2fx"}, 400),
        ({"url": "echo.mar", "model_name": "/abs"}, 400),
        ({"url": "echo.mar", "model_name": ".."}, 400),
        ({"url": "../etc/passwd"}, 403),
        ({"url": "../outside/x.mar"}, 403),
        ({"url": "/etc/passwd"}, 403),
        ({"url": "file:///etc/passwd"}, 403),
        ({"url": f"{outside}/x.mar"}, 403),
        ({"url": ".."}, 400),
        ({"url": "."}, 400),
        ({"url": f"{model_store}/../outside/x.mar"}, 400),
        ({"url": f"file://{model_store}/../outside/x.mar"}, 400),
        ({"url": f"file://{model_store}/%2e%2e/outside/x.mar"}, 400),
        ({"url": "a\x00b.mar"}, 400),
    ]
    for params, status in refused:
        answer = requests.post(models, params={**params, "initial_workers": 0}, timeout=30)
        _error(answer, status)
    # %2e%2e in the query string itself decodes to '..' before anything looks at it.
    encoded = requests.post(f"{models}?url=%2e%2e/x.mar&initial_workers=0", timeout=30)
    assert "'../x.mar'" in _error(encoded, 403)
    predicted = requests.post(f"{server.inference}/predictions/..%2fecho", data=b"x", timeout=10)
    _error(predicted, 404)

    listed = requests.get(models, timeout=10).json()
    assert [m["modelName"] for m in listed["models"]] == ["echo"]
    assert _tree(tmp_path) == before, "something was written outside the model store"
    assert _tree(run_dir) == run_before, "a refused registration left files behind"
    _assert_healthy(server)


def test_an_overlong_archive_name_is_400(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar")
    answer = requests.post(f"{server.management}/models",
                           params={"url": "a" * 300 + ".mar"}, timeout=30)
    _error(answer, 400)


# ---- hostile archives in the model store ----------------------------------------------------

def _evil_copy(source: Path, dest: Path, members: list[tuple[str, bytes, int]]) -> Path:
    """A copy of a good .mar with extra members ``(name, data, unix mode)`` appended."""
    dest.write_bytes(source.read_bytes())
    with zipfile.ZipFile(dest, "a") as archive:
        for name, data, mode in members:
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            archive.writestr(info, data)
    return dest


def _evil_tar(source: Path, dest: Path, member: tarfile.TarInfo) -> Path:
    """A .tar.gz holding the files of a good .mar, plus ``member``."""
    with zipfile.ZipFile(source) as good, tarfile.open(dest, "w:gz") as archive:
        for name in good.namelist():
            data = good.read(name)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        archive.addfile(member)
    return dest


def _symlink(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    return info


def test_zip_slip_archives_are_400_and_write_nothing_outside(
        build_mar, start_server, model_store: Path, tmp_path: Path) -> None:
    good = build_mar("echo", "echo")
    marker = f"evil-{uuid.uuid4().hex}.py"
    file_mode = stat.S_IFREG | 0o644
    link_mode = stat.S_IFLNK | 0o777
    archives = {
        "dotdot.mar": [(f"../{marker}", b"print('pwned')", file_mode)],
        "deep.mar": [(f"{'../' * 8}tmp/{marker}", b"x", file_mode)],
        "inner.mar": [(f"MAR-INF/../../{marker}", b"x", file_mode)],
        "absolute.mar": [(f"/tmp/{marker}", b"x", file_mode)],
        "link.mar": [("escape", b"/tmp", link_mode)],
    }
    for name, members in archives.items():
        _evil_copy(good, model_store / name, members)
    _evil_tar(good, model_store / "link.tar.gz", _symlink("escape", "/tmp"))
    _evil_tar(good, model_store / "dotdot.tar.gz", _symlink(f"../{marker}", "echo.py"))
    server = start_server("echo.mar")
    run_dir = server.server.services.loader.run_dir  # type: ignore[union-attr]
    before = _tree(tmp_path)
    for name in [*archives, "link.tar.gz", "dotdot.tar.gz"]:
        answer = requests.post(f"{server.management}/models",
                               params={"url": name, "model_name": "evil"}, timeout=30)
        message = _error(answer, 400, "ModelArchiveException")
        assert "unsafe path" in message or "link" in message or "only files" in message
    for folder in (run_dir.parent, run_dir, run_dir / "models", model_store, tmp_path, Path("/")):
        assert not (folder / marker).exists(), folder
    assert not list((run_dir / "models").glob("**/escape")), "an extraction was left behind"
    assert _tree(tmp_path) == before
    listed = requests.get(f"{server.management}/models", timeout=10).json()
    assert [m["modelName"] for m in listed["models"]] == ["echo"]
    _assert_healthy(server)


def test_an_archive_with_clashing_members_is_400(build_mar, start_server,
                                                 model_store: Path) -> None:
    good = build_mar("echo", "echo")
    _evil_copy(good, model_store / "clash.mar",
               [("a", b"file", stat.S_IFREG | 0o644), ("a/b", b"x", stat.S_IFREG | 0o644)])
    server = start_server("echo.mar")
    answer = requests.post(f"{server.management}/models",
                           params={"url": "clash.mar", "model_name": "clash"}, timeout=30)
    _error(answer, 400, "ModelArchiveException")


# ---- handler output that cannot be sent -----------------------------------------------------

def _batch_of_four(server: RunningServer, bodies: list[bytes]) -> list[requests.Response]:
    assert len(bodies) == 4
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda body: server.predict("unserialisable", body), bodies))


@pytest.fixture
def unserialisable(build_mar, start_server) -> RunningServer:
    build_mar("unserialisable", "unserialisable")
    build_mar("echo", "echo")
    server = start_server("echo.mar")
    # batch_size 4, fixed policy, long delay: four concurrent requests form exactly one batch.
    requests.post(f"{server.management}/models",
                  params={"url": "unserialisable.mar", "batch_size": 4, "max_batch_delay": 5000,
                          "batch_policy": "fixed", "initial_workers": 1, "synchronous": "true"},
                  timeout=60).raise_for_status()
    return server


def test_unserialisable_output_fails_only_its_own_request(
        unserialisable: RunningServer) -> None:
    server = unserialisable
    cases = [(b"set", "TypeError", "not JSON serializable"),
             (b"object", "TypeError", "not JSON serializable"),
             (b"circular", "ValueError", "Circular reference")]
    for bad, error_type, words in cases:
        bodies = [b"first", bad, b"third", b"fourth"]
        answers = _batch_of_four(server, bodies)
        for body, answer in zip(bodies, answers, strict=True):
            if body == bad:
                # TorchServe's type for the status; the handler's exception in the message.
                message = _error(answer, 500, "InternalServerException")
                assert message.startswith(f"{error_type}: ") and words in message
            else:
                assert answer.status_code == 200 and answer.content == body
    described = server.describe("unserialisable")
    assert described["batching"]["recentBatchSizes"] == [4, 4, 4]  # type: ignore[index]
    assert described["workers"][0]["restarts"] == 0  # type: ignore[index]
    _assert_healthy(server)


def test_a_too_deeply_nested_output_fails_only_its_own_request(
        unserialisable: RunningServer) -> None:
    bodies = [b"first", b"deep", b"third", b"fourth"]
    answers = _batch_of_four(unserialisable, bodies)
    assert [a.status_code for a in answers] == [200, 500, 200, 200]


def test_a_response_header_outside_latin_1_is_sent_with_replacements(
        unserialisable: RunningServer) -> None:
    bodies = [b"first", b"header", b"third", b"fourth"]
    answers = _batch_of_four(unserialisable, bodies)
    assert [a.status_code for a in answers] == [200, 200, 200, 200]
    assert answers[1].headers["x-note"] == "? uro"  # HTTP headers are latin-1


def test_a_response_header_that_would_split_the_response_fails_only_its_request(
        unserialisable: RunningServer) -> None:
    bodies = [b"first", b"split", b"third", b"fourth"]
    answers = _batch_of_four(unserialisable, bodies)
    assert [a.status_code for a in answers] == [200, 500, 200, 200]
    assert "invalid HTTP header" in _error(answers[1], 500)
    assert all("x-injected" not in answer.headers for answer in answers)
    _assert_healthy(unserialisable)


# ---- hypothesis over the HTTP APIs ----------------------------------------------------------

MODEL_PARAMS = ["url", "model_name", "handler", "runtime", "batch_size", "max_batch_delay",
                "initial_workers", "response_timeout", "startup_timeout", "batch_policy",
                "synchronous", "min_worker", "max_worker", "number_gpu", "timeout", "limit",
                "next_page_token", "customized", "type"]
texts = st.text(max_size=12)
names = st.sampled_from(["echo"] * 4 + ["nope", "..", "%2e%2e", "a/b"]) | texts
values = st.sampled_from(["-1", "0", "1", "2", "true", "false", "x", "", "1e3", "9" * 30,
                          "echo.mar", "other.mar", "../x.mar", "/etc/passwd", "%00",
                          "file:///etc/passwd", "http://127.0.0.1:1/x.mar"]) | texts


@st.composite
def http_requests(draw: st.DrawFn) -> tuple[str, str, str, dict[str, str], bytes, str]:
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"]))
    name, version = draw(names), draw(st.sampled_from(["1.0", "9.9", "all", ""]) | texts)
    template = draw(st.sampled_from([
        "/models", "/models", "/models/{n}", "/models/{n}", "/models/{n}/{v}",
        "/models/{n}/{v}/set-default", "/predictions/{n}", "/predictions/{n}",
        "/predictions/{n}/{v}", "/ping", "/api-description", "/token", "/", "/{n}"]))
    if name == "echo" and method in ("PUT", "DELETE", "POST") and template.startswith("/models/"):
        name = "nope"  # never scale or remove the one real model: that is not bad input
    path = template.format(n=quote(name, safe=""), v=quote(version, safe=""))
    if template.startswith(("/models", "/token")):
        api = "management"
    elif template.startswith(("/predictions", "/ping")):
        api = "inference"
    else:
        api = draw(st.sampled_from(["inference", "management"]))
    params = draw(st.dictionaries(st.sampled_from(MODEL_PARAMS), values, max_size=4))
    if params.get("url") == "echo.mar":
        params["url"] = "other.mar"  # a valid registration would start workers
    content_type = draw(st.sampled_from(["", "application/json", MULTIPART, "text/plain",
                                         "application/x-www-form-urlencoded",
                                         "multipart/form-data"]))
    body = draw(st.binary(max_size=64) | st.just(PART + b"--XyZ--\r\n"))
    return api, method, path, params, body, content_type


def test_fuzzed_http_requests_get_4xx_or_success_never_a_crash(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar", max_request_size_bytes=LIMIT)
    session = requests.Session()
    seen: list[int] = []

    @settings(max_examples=120, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(request=http_requests())
    def check(request: tuple[str, str, str, dict[str, str], bytes, str]) -> None:
        api, method, path, params, body, content_type = request
        base = server.inference if api == "inference" else server.management
        headers = {"content-type": content_type} if content_type else {}
        answer = session.request(method, base + path, params=params, data=body,
                                 headers=headers, timeout=30)
        seen.append(answer.status_code)
        assert answer.status_code < 500, (method, path, params, answer.text)
        if answer.status_code >= 400:
            _error(answer, answer.status_code)

    try:
        check()
    finally:
        session.close()
    assert any(status >= 400 for status in seen)
    assert any(status == 200 for status in seen)
    listed = requests.get(f"{server.management}/models", timeout=10).json()
    assert [m["modelName"] for m in listed["models"]] == ["echo"]
    assert len(server.describe("echo")["workers"]) == 1  # type: ignore[arg-type]
    _assert_healthy(server)


def test_no_file_descriptor_is_left_open_by_refused_requests(build_mar, start_server) -> None:
    """Refusals close what they opened: the frontend's descriptors come back to the start."""
    import psutil

    build_mar("echo", "echo")
    server = start_server("echo.mar", max_request_size_bytes=LIMIT)
    me = psutil.Process(os.getpid())
    _assert_healthy(server)
    baseline = me.num_fds()
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", _port(server.inference))) as sock:
            sock.sendall(b"POST /predictions/echo HTTP/1.1\r\nHost: t\r\n"
                         b"Content-Length: 99999999\r\n\r\n")
            _raw_error(_read_response(sock), 413)
        _error(requests.post(f"{server.management}/models", params={"url": "../x.mar"},
                             timeout=10), 403)
    server.wait_for(lambda: me.num_fds() <= baseline + 2, "the descriptors to be closed",
                    timeout_s=10)


# ---- a hostile file system around the key file ------------------------------------------------

@pytest.mark.parametrize("planted", ["file", "symlink"])
def test_the_key_file_is_private_even_when_its_temporary_name_was_planted(
        tmp_path: Path, planted: str) -> None:
    from frontend.ops.auth import TokenAuthority

    key_file = tmp_path / "key_file.json"
    temporary = tmp_path / f".{key_file.name}.{os.getpid()}.tmp"
    victim = tmp_path / "victim"
    victim.write_text("someone else's file\n")
    victim.chmod(0o644)
    if planted == "file":
        temporary.write_text("")
        temporary.chmod(0o644)
    else:
        temporary.symlink_to(victim)
    authority = TokenAuthority(key_file, expiration_min=60)
    try:
        authority.start()
    except OSError:
        return  # refusing to start is a fine answer too
    try:
        assert not key_file.is_symlink()
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        assert victim.read_text() == "someone else's file\n"
    finally:
        authority.remove()
