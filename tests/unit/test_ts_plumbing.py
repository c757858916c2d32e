"""The rest of batchserve's ``ts``: TorchServe's own worker protocol (``ts.protocol``,
``ts.service``, ``ts.model_loader``, ``ts.model_service_worker``), the request envelopes as
classes, and the small helpers (tokenizer, argument parsers, properties, decorators).

The worker protocol is driven over a socket pair with frames this test writes from
TorchServe's format (4-byte big-endian integers, length-prefixed strings, -1 ending lists),
and the answers are read back the same way.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import HANDLERS
from tests.unit.test_ts_compat import TS_HANDLERS, ts_shim

__all__ = ["ts_shim"]  # the autouse fixture that installs the shim for each test


# --- TorchServe's frames, written and read independently of the shim ------------------------


def string(value: str | bytes) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return struct.pack("!i", len(data)) + data


def load_frame(name: str, path: Path, handler: str, envelope: str = "") -> bytes:
    return (b"L" + string(name) + string(str(path)) + struct.pack("!i", 4) + string(handler)
            + struct.pack("!i", -1) + string(envelope) + b"\x01")


def predict_frame(*requests: tuple[str, dict[str, str], list[tuple[str, str, bytes]]]
                  ) -> bytes:
    frame = b"I"
    for request_id, headers, inputs in requests:
        frame += string(request_id)
        for name, value in headers.items():
            frame += string(name) + string(value)
        frame += struct.pack("!i", -1)
        for name, content_type, value in inputs:
            frame += string(name) + string(content_type) + string(value)
        frame += struct.pack("!i", -1)
    return frame + struct.pack("!i", -1)


class Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def bytes(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            assert chunk, "the worker closed the connection"
            data += chunk
        return data

    def int(self) -> int:
        value: int = struct.unpack("!i", self.bytes(4))[0]
        return value

    def string(self) -> bytes:
        return self.bytes(self.int())

    def response(self) -> dict[str, Any]:
        """A predict (or load) response: code, message, and each request's answer."""
        answer: dict[str, Any] = {"code": self.int(), "message": self.string().decode(),
                                  "predictions": []}
        while (length := self.int()) != -1:
            prediction = {"id": self.bytes(length).decode(),
                          "content_type": self.string().decode(), "status": self.int(),
                          "phrase": self.string().decode()}
            prediction["headers"] = {self.string().decode(): self.string().decode()
                                     for _ in range(self.int())}
            prediction["body"] = self.string()
            answer["predictions"].append(prediction)
        return answer


@pytest.fixture
def worker_connection(tmp_path: Path) -> Iterator[tuple[socket.socket, Any]]:
    """A TorchModelServiceWorker serving one end of a socket pair on a thread."""
    from ts.model_service_worker import TorchModelServiceWorker

    worker = TorchModelServiceWorker("unix", str(tmp_path / "ts.sock.9000"))
    ours, theirs = socket.socketpair()
    exits: list[object] = []

    def serve() -> None:
        try:
            worker.handle_connection(theirs)
        except SystemExit as exc:
            exits.append(exc.code)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ours.settimeout(60)
    yield ours, worker
    ours.close()  # the worker reads the end of the stream and returns
    thread.join(timeout=30)
    theirs.close()
    thread.join(timeout=30)
    # As TorchServe's worker does when its frontend goes away: exit with status 0.
    assert not thread.is_alive() and exits == [0]
    worker.sock.close()
    theirs.close()


def model_dir(tmp_path: Path, *handlers: Path) -> Path:
    folder = tmp_path / "model"
    (folder / "MAR-INF").mkdir(parents=True)
    for handler in handlers:
        shutil.copy(handler, folder / handler.name)
    (folder / "MAR-INF" / "MANIFEST.json").write_text(json.dumps(
        {"runtime": "python", "model": {"modelName": "m", "modelVersion": "2.0",
                                        "handler": handlers[0].name}}))
    return folder


def test_torchserve_worker_loads_and_predicts_over_torchserve_frames(
        tmp_path: Path, worker_connection: tuple[socket.socket, Any]) -> None:
    sock, _ = worker_connection
    reader = Reader(sock)
    folder = model_dir(tmp_path, HANDLERS / "echo.py")

    sock.sendall(load_frame("m", folder, "echo.py:upper"))
    assert reader.response() == {"code": 200, "message": "loaded model m", "predictions": []}

    sock.sendall(predict_frame(
        ("r1", {"x-trace": "7"}, [("body", "text/plain", b"hello")]),
        ("r2", {}, [("body", "application/octet-stream", b"\x00raw")]),
        ("r3", {}, [("body", "application/json", b'{"a": [1, 2]}')])))
    answer = reader.response()

    assert (answer["code"], answer["message"]) == (200, "Prediction success")
    # Raw inputs reach the handler as TorchServe's do, as a bytearray, which echo.py:upper
    # leaves as it is (it upper-cases str and bytes).
    assert [(p["id"], p["status"], p["body"]) for p in answer["predictions"]] == [
        ("r1", 200, b"HELLO"), ("r2", 200, b"\x00raw"),
        ("r3", 200, json.dumps({"a": [1, 2]}, indent=2).encode())]


def test_torchserve_worker_answers_a_prediction_exception_with_its_code(
        tmp_path: Path, worker_connection: tuple[socket.socket, Any]) -> None:
    sock, _ = worker_connection
    reader = Reader(sock)
    sock.sendall(load_frame("m", model_dir(tmp_path, TS_HANDLERS / "teapot.py"), "teapot"))
    assert reader.response()["code"] == 200

    sock.sendall(predict_frame(("r1", {}, [("body", "text/plain", b"teapot")])))
    answer = reader.response()

    assert (answer["code"], answer["message"]) == (418, "I'm a teapot, not a coffee machine")
    assert [(p["status"], p["body"]) for p in answer["predictions"]] == [(418, b"error")]


def test_torchserve_worker_streams_intermediate_parts_on_its_socket(
        tmp_path: Path, worker_connection: tuple[socket.socket, Any]) -> None:
    sock, _ = worker_connection
    reader = Reader(sock)
    sock.sendall(load_frame("m", model_dir(tmp_path, TS_HANDLERS / "streamer.py"), "streamer"))
    assert reader.response()["code"] == 200

    sock.sendall(predict_frame(("r1", {}, [("body", "text/plain", b"a")])))
    parts = [reader.response() for _ in range(3)]

    assert [p["predictions"][0]["body"] for p in parts] == [
        b"part 0 of a", b"part 1 of a", b"done with a"]
    assert [p["predictions"][0]["headers"].get("ts_stream_next") for p in parts] == [
        "true", "true", "false"]


def test_torchserve_worker_reports_a_handler_that_cannot_load(
        tmp_path: Path, worker_connection: tuple[socket.socket, Any]) -> None:
    _, worker = worker_connection
    service, message, code = worker.load_model({
        "modelPath": str(model_dir(tmp_path, HANDLERS / "echo.py")).encode(),
        "modelName": b"m", "handler": b"no_such_handler", "batchSize": 1})
    assert (service, message, code) == (None, "Unknown exception", 500)


def test_service_decodes_a_predict_message_as_torchserve_does() -> None:
    from ts.protocol.otf_message_handler import retrieve_msg
    from ts.service import Service

    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.sendall(predict_frame(("r1", {"X-Trace": "7"}, [
            ("data", "image/png", b"\x89PNG"), ("meta", "application/json", b"[1]")])))
        command, batch = retrieve_msg(theirs)

    headers, inputs, ids = Service.retrieve_data_for_inference(batch)

    assert command == b"I"
    assert ids == {0: "r1"}
    assert inputs == [{"data": b"\x89PNG", "meta": [1]}]
    assert headers[0].get_request_property("X-Trace") == "7"
    assert headers[0].get_request_property("data") == {"content-type": "image/png"}


def test_model_loader_wraps_the_entry_point_in_a_named_envelope(tmp_path: Path) -> None:
    from ts.model_loader import ModelLoaderFactory

    rows = tmp_path / "rows.py"
    rows.write_text("def handle(data, context):\n"
                    "    return None if data is None else [repr(row) for row in data]\n")
    service = ModelLoaderFactory.get_model_loader().load(
        "m", str(model_dir(tmp_path, rows)), "rows", None, 2, "json")
    frame = service.predict([{"requestId": b"r1", "headers": [], "parameters": [
        {"name": "body", "contentType": "application/json",
         "value": {"instances": [{"b64": base64.b64encode(b"img").decode()}, 7]}}]}])

    sock_a, sock_b = socket.socketpair()
    with sock_a, sock_b:
        sock_a.sendall(frame)
        answer = Reader(sock_b).response()
    assert answer["predictions"][0]["body"] == b'{"predictions": ["b\'img\'", "7"]}'
    assert service.context.model_yaml_config == {}
    assert service.context.manifest["model"]["modelVersion"] == "2.0"


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_failing_entry_point_is_answered_as_torchserve_answers_it(
        tmp_path: Path, asynchronous: bool) -> None:
    """Service.predict and the async service's predict map an entry point's failures alike:
    a PredictionException's code, 503 for any other error, a result that is not a list or not
    of the batch's length."""
    from ts.model_loader import ModelLoaderFactory

    handler = tmp_path / "faulty.py"
    # An async entry point is a class's (TorchServe calls a function's at load, unawaited).
    handler.write_text(
        "from ts.utils.util import PredictionException\n"
        "class Faulty:\n"
        "    def initialize(self, context):\n"
        "        pass\n"
        f"    {'async ' if asynchronous else ''}def handle(self, data, context):\n"
        "        body = data[0]['body']\n"
        "        if body == b'teapot':\n"
        "            raise PredictionException('short and stout', 418)\n"
        "        if body == b'boom':\n"
        "            raise RuntimeError('boom')\n"
        "        if body == b'dict':\n"
        "            return {'not': 'a list'}\n"
        "        if body == b'short':\n"
        "            return []\n"
        "        return [row['body'].upper() for row in data]\n")
    service = ModelLoaderFactory.get_model_loader().load(
        "m", str(model_dir(tmp_path, handler)), "faulty", None, 1)
    if asynchronous:
        from ts.async_service import predict

        def answer(body: bytes) -> dict[str, Any]:
            frame = asyncio.run(predict(service, request(body)))
            return read_frame(frame)
    else:
        def answer(body: bytes) -> dict[str, Any]:
            return read_frame(service.predict(request(body)))

    def request(body: bytes) -> list[dict[str, Any]]:
        return [{"requestId": b"r1", "headers": [], "parameters": [
            {"name": "body", "contentType": "application/octet-stream", "value": body}]}]

    def read_frame(frame: bytearray | None) -> dict[str, Any]:
        assert frame is not None
        sock_a, sock_b = socket.socketpair()
        with sock_a, sock_b:
            sock_a.sendall(frame)
            return Reader(sock_b).response()

    outcomes = {body: (reply["code"], reply["message"]) for body in
                (b"teapot", b"boom", b"dict", b"short") for reply in [answer(body)]}
    assert outcomes == {b"teapot": (418, "short and stout"), b"boom": (503, "Prediction failed"),
                        b"dict": (503, "Invalid model predict output"),
                        b"short": (503, "number of batch response mismatched")}
    served = answer(b"tea")
    assert (served["code"], served["predictions"][0]["body"]) == (200, b"TEA")


# --- the request envelopes as classes -----------------------------------------------------------


def echo_rows(data: list[Any], context: Any) -> list[Any]:
    return [f"seen {row}" for row in data]


class FakeContext:
    """What the envelopes read of a context (request ids, headers, the manifest), and no
    more: TorchServe's handler tests pass such a MockContext."""

    def __init__(self, explain: bool = False) -> None:
        self.manifest = {"model": {"modelName": "m", "modelVersion": "3"}}
        self.explain = explain

    def get_request_header(self, idx: int, name: str) -> str | None:
        return "True" if name == "explain" and self.explain else None

    def get_request_id(self, idx: int = 0) -> str:
        return f"id{idx}"


def test_kserve_envelope_answers_every_request_of_a_batch() -> None:
    from ts.torch_handler.request_envelope.kserve import KServeEnvelope

    answers = KServeEnvelope(echo_rows).handle(
        [{"body": {"instances": [1, 2]}}, {"body": b'{"instances": [3]}'}], FakeContext())
    assert answers == [{"predictions": ["seen 1", "seen 2"]}, {"predictions": ["seen 3"]}]
    explained = KServeEnvelope(echo_rows).handle([{"data": {"instances": [1]}}],
                                                 FakeContext(explain=True))
    assert explained == [{"explanations": ["seen 1"]}]


def test_json_and_body_envelopes() -> None:
    from ts.torch_handler.request_envelope.body import BodyEnvelope
    from ts.torch_handler.request_envelope.json import JSONEnvelope

    answers = JSONEnvelope(echo_rows).handle(
        [{"body": {"instances": [{"b64": base64.b64encode(b"x").decode()}]}},
         {"instances": [5, 6]}], FakeContext())
    assert answers == ['{"predictions": ["seen b\'x\'"]}', '{"predictions": ["seen 5", "seen 6"]}']
    assert BodyEnvelope(echo_rows).handle([{"body": "a"}, {"data": "b"}], None) == [
        "seen a", "seen b"]


def test_kservev2_envelope_names_outputs_after_inputs() -> None:
    from ts.torch_handler.request_envelope.kservev2 import KServev2Envelope

    def doubled(data: list[Any], context: Any) -> list[Any]:
        assert context.input_names == ["x"]
        return [[[2 * value for value in row] for row in data[0]["data"]]]

    context = FakeContext()
    answers = KServev2Envelope(doubled).handle([{"body": {"id": "q", "inputs": [
        {"name": "x", "shape": [2, 2], "datatype": "INT64", "data": [1, 2, 3, 4]}]}}], context)
    assert answers == [{"id": "q", "model_name": "m", "model_version": "3", "outputs": [
        {"name": "x", "datatype": "INT64", "data": [2, 4, 6, 8], "shape": [4]}]}]


# --- small helpers ------------------------------------------------------------------------------


def test_text_utils_tokenize_and_ngrams_as_torchtext() -> None:
    from ts.handler_utils.text_utils import get_tokenizer, ngrams_iterator

    tokenizer = get_tokenizer("basic_english")
    assert tokenizer("You can now install TorchText using pip!") == [
        "you", "can", "now", "install", "torchtext", "using", "pip", "!"]
    assert get_tokenizer(None)("a  b") == ["a", "b"]
    assert list(ngrams_iterator(["here", "we", "are"], 2)) == [
        "here", "we", "are", "here we", "we are"]
    with pytest.raises(ValueError, match="spacy"):
        get_tokenizer("spacy")


def test_arg_parsers_read_torchserve_command_lines(tmp_path: Path) -> None:
    from ts.arg_parser import ArgParser
    from ts.model_server import load_properties

    args = ArgParser.extract_args(["--start", "--ncs", "--model-store", "store", "--models",
                                   "a=a.mar", "b.mar", "--dt", "--ppath", "plugins"])
    assert (args.start, args.no_config_snapshots, args.model_store, args.models,
            args.token_auth, args.plugins_path) == (True, True, "store", ["a=a.mar", "b.mar"],
                                                    True, "plugins")
    worker = ArgParser.model_service_worker_args().parse_args(
        ["--sock-type", "tcp", "--host", "127.0.0.1", "--port", "9000", "--async"])
    assert (worker.sock_type, worker.port, worker.async_comm) == ("tcp", "9000", True)
    properties = tmp_path / "config.properties"
    properties.write_text("# comment\ninference_address = http://0.0.0.0:8080\nflag\n"
                          "vmargs=-Xmx1g -Da=b=c\n")
    assert load_properties(str(properties)) == {
        "inference_address": "http://0.0.0.0:8080", "vmargs": "-Xmx1g -Da=b=c"}


def test_util_decorators_and_backends(capsys: pytest.CaptureFixture[str]) -> None:
    import ts
    from ts.utils.timeit_decorator import timeit
    from ts.utils.util import check_valid_pt2_backend, deprecated

    @deprecated(version=1.0, replacement="new_function")
    def old_function(value: int) -> int:
        return value + 1

    with pytest.warns(PendingDeprecationWarning, match="old_function is deprecated in 1.0"):
        assert old_function(1) == 2
    assert timeit(lambda: 3)() == 3
    assert "took a total of" in capsys.readouterr().out
    assert check_valid_pt2_backend("inductor") and not check_valid_pt2_backend("warp")
    assert ts.__version__ == "0.12.0"


def test_single_node_service_reads_its_signature_and_runs_its_steps(tmp_path: Path) -> None:
    from ts.model_service.model_service import SingleNodeService

    (tmp_path / "signature.json").write_text(json.dumps(
        {"input_type": "application/json", "inputs": [{"data_name": "x"}]}))

    class Doubler(SingleNodeService):
        def _inference(self, data: list[Any]) -> list[Any]:
            return [value * 2 for value in data]

    class Context:
        system_properties = {"model_dir": str(tmp_path)}
        manifest = {"Model": {"Signature": "signature.json"}}

    service = Doubler("m", str(tmp_path), None)
    service.initialize(Context())
    assert service.signature() == {"input_type": "application/json",
                                   "inputs": [{"data_name": "x"}]}
    assert service.handle([{"x": b"[1, 2]"}], None) == [[1, 2, 1, 2]]
    assert service.ping() is None


def test_request_headers_are_found_whatever_the_case_of_their_name() -> None:
    """They reach the worker lower-cased; handlers written for TorchServe (which keeps the
    client's case) look up "Content-Type" or SageMaker's custom attributes header."""
    from backend.context import RequestProcessor

    headers = RequestProcessor({"content-type": "application/x-npy",
                                "x-amzn-sagemaker-custom-attributes": "trace=1"}
                               ).get_request_properties()
    assert headers.get("Content-Type") == "application/x-npy"
    assert headers["X-Amzn-SageMaker-Custom-Attributes"] == "trace=1"
    assert "CONTENT-TYPE" in headers and "accept" not in headers
    assert headers.get("Accept") is None and headers.get("Accept", "*/*") == "*/*"
    assert dict(headers) == {"content-type": "application/x-npy",
                             "x-amzn-sagemaker-custom-attributes": "trace=1"}
    with pytest.raises(KeyError):
        headers["Accept"]
