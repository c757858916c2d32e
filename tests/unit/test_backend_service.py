"""ModelService and the handler loader, in process, with the toy handlers of tests/fixtures."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from backend.context import Context
from backend.errors import (
    BatchSizeMismatch,
    HandlerLoadError,
    InvalidHandlerOutput,
    InvalidInput,
    classify,
)
from backend.service.model_service import ModelService, load_service
from protos import worker_pb2
from tests.unit.imports import restore_import_state  # noqa: F401 (a fixture)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "handlers"


pytestmark = pytest.mark.usefixtures("restore_import_state")


def model_dir_with(tmp_path: Path, *fixtures: str, files: dict[str, str] | None = None) -> Path:
    """A model directory holding copies of the named fixture handlers and any extra files."""
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    for name in fixtures:
        shutil.copy(FIXTURES / name, model_dir / name)
    for name, text in (files or {}).items():
        (model_dir / name).write_text(textwrap.dedent(text))
    return model_dir


def load_message(model_dir: Path, handler: str, **fields: Any) -> worker_pb2.LoadModel:
    values: dict[str, Any] = {
        "model_name": "toy",
        "model_version": "1.0",
        "model_dir": str(model_dir),
        "handler": handler,
        "batch_size": 4,
        "gpu_id": -1,
        "manifest_json": "{}",
        "limit_max_image_pixels": True,
        "decode_input_request": True,
        "server_version": "0.1.0",
    }
    values.update(fields)
    return worker_pb2.LoadModel(**values)


def load(tmp_path: Path, handler: str, *fixtures: str, **fields: Any) -> ModelService:
    return load_service(load_message(model_dir_with(tmp_path, *fixtures), handler, **fields))


def request(
    body: bytes,
    *,
    content_type: str | None = None,
    headers: dict[str, str] | None = None,
    request_id: str = "r",
    name: str = "body",
) -> worker_pb2.Request:
    req = worker_pb2.Request(request_id=request_id, inputs={name: body}, headers=headers or {})
    if content_type is not None:
        req.content_types[name] = content_type
    return req


def batch(*requests: worker_pb2.Request, batch_id: int = 7) -> worker_pb2.PredictBatch:
    return worker_pb2.PredictBatch(batch_id=batch_id, requests=list(requests))


def bodies(bodies: list[bytes]) -> worker_pb2.PredictBatch:
    return batch(*(request(b, request_id=f"r{i}") for i, b in enumerate(bodies)))


# --- happy paths ----------------------------------------------------------------------------


def test_echo_returns_each_body_in_request_order(tmp_path: Path) -> None:
    service = load(tmp_path, "echo.py", "echo.py")

    result = service.predict(bodies([b"first", b"\x00\xffsecond", b""]))

    assert result.batch_id == 7
    assert result.handler_time_ms >= 0
    assert [r.request_id for r in result.responses] == ["r0", "r1", "r2"]
    assert [r.body for r in result.responses] == [b"first", b"\x00\xffsecond", b""]
    for response in result.responses:
        assert response.status == 200
        assert response.content_type == "application/octet-stream"
        assert response.error == ""


def test_json_body_is_decoded_and_answered_as_pretty_json(tmp_path: Path) -> None:
    service = load(tmp_path, "echo.py", "echo.py")
    payload = {"instances": [[1, 2], [3, 4]], "name": "ü"}

    result = service.predict(
        batch(request(json.dumps(payload).encode(), content_type="application/json"))
    )

    (response,) = result.responses
    assert response.content_type == "application/json"
    assert response.body == json.dumps(payload, indent=2).encode()


def test_body_content_type_falls_back_to_the_request_header(tmp_path: Path) -> None:
    service = load(tmp_path, "echo.py", "echo.py")

    result = service.predict(
        batch(
            request(b'{"a": 1}', headers={"Content-Type": "application/json; charset=utf-8"}),
            request("héllo".encode(), headers={"content-type": "text/plain"}),
        )
    )

    assert json.loads(result.responses[0].body) == {"a": 1}
    assert result.responses[0].content_type == "application/json"
    assert result.responses[1].body == "héllo".encode()
    assert result.responses[1].content_type == "text/plain; charset=utf-8"


def test_undecodable_inputs_stay_bytes(tmp_path: Path) -> None:
    service = load(tmp_path, "echo.py", "echo.py")

    result = service.predict(
        batch(
            request(b"{not json", content_type="application/json"),
            request(b"\xff\xfe", content_type="text/plain"),
        )
    )

    assert [r.body for r in result.responses] == [b"{not json", b"\xff\xfe"]
    assert all(r.content_type == "application/octet-stream" for r in result.responses)


def test_form_field_inputs_use_their_own_content_type(tmp_path: Path) -> None:
    service = load(tmp_path, "echo.py", "echo.py")

    result = service.predict(
        batch(request(b"[1, 2]", content_type="application/json", name="data"))
    )

    assert json.loads(result.responses[0].body) == [1, 2]


def test_decoding_can_be_turned_off(tmp_path: Path) -> None:
    service = load(tmp_path, "echo.py", "echo.py", decode_input_request=False)

    result = service.predict(batch(request(b'{"a": 1}', content_type="application/json")))

    assert result.responses[0].body == b'{"a": 1}'
    assert result.responses[0].content_type == "application/octet-stream"


@pytest.mark.parametrize("handler", ["echo.py:upper", "echo:upper"])
def test_named_function_entry_point(tmp_path: Path, handler: str) -> None:
    service = load(tmp_path, handler, "echo.py")

    result = service.predict(batch(request(b"shout", content_type="text/plain")))

    assert result.responses[0].body == b"SHOUT"
    assert result.responses[0].content_type == "text/plain; charset=utf-8"


def test_handler_named_without_py_suffix(tmp_path: Path) -> None:
    service = load(tmp_path, "batch_len", "batch_len.py")

    result = service.predict(bodies([b"a", b"b", b"c"]))

    assert [r.body for r in result.responses] == [b"3", b"3", b"3"]
    assert all(r.content_type == "application/json" for r in result.responses)


def test_function_entry_point_is_initialised_with_none(tmp_path: Path) -> None:
    model_dir = model_dir_with(
        tmp_path,
        files={
            "init_check.py": """
                calls = []

                def handle(data, context):
                    calls.append(data)
                    if data is None:
                        context.manifest["initialised_with"] = "None"
                        return None
                    return [len(calls)] * len(data)
            """
        },
    )
    service = load_service(load_message(model_dir, "init_check.py"))

    assert service.context.manifest == {"initialised_with": "None"}
    assert service.predict(bodies([b"x"])).responses[0].body == b"2"


def test_class_handler_is_initialised_and_uses_the_context(tmp_path: Path) -> None:
    service = load(tmp_path, "class_based.py", "class_based.py", model_name="cats")

    result = service.predict(
        batch(
            request(b"plain", content_type="text/plain", request_id="a"),
            request(b"x", headers={"X-WANT-STATUS": "202"}, request_id="b"),
        )
    )

    first, second = result.responses
    assert json.loads(first.body) == {
        "model": "cats",
        "initialized": True,
        "batch_size": 4,
        "request_id": "a",
        "input": "plain",
    }
    assert first.status == 200
    assert dict(first.headers) == {"X-Model": "cats"}
    assert first.content_type == "application/json"
    assert (second.status, second.reason) == (202, "Custom")
    assert dict(second.headers) == {"X-Model": "cats"}


def test_response_state_is_reset_between_batches(tmp_path: Path) -> None:
    service = load(tmp_path, "class_based.py", "class_based.py")
    service.predict(batch(request(b"x", headers={"x-want-status": "201"})))

    result = service.predict(batch(request(b"x")))

    assert result.responses[0].status == 200
    assert result.responses[0].reason == ""


def test_content_type_set_by_the_handler_wins(tmp_path: Path) -> None:
    model_dir = model_dir_with(
        tmp_path,
        files={
            "typed.py": """
                def handle(data, context):
                    if data is None:
                        return None
                    context.set_response_content_type(0, "image/png")
                    context.set_response_header(1, "Content-Type", "text/csv")
                    context.set_response_header(1, "X-Extra", "yes")
                    return [b"\\x89PNG", "a,b"]
            """
        },
    )
    service = load_service(load_message(model_dir, "typed.py"))

    png, csv = service.predict(bodies([b"1", b"2"])).responses

    assert (png.content_type, png.body, dict(png.headers)) == ("image/png", b"\x89PNG", {})
    assert (csv.content_type, csv.body, dict(csv.headers)) == (
        "text/csv",
        b"a,b",
        {"X-Extra": "yes"},
    )


def test_archive_modules_are_importable_and_cannot_shadow_the_worker(tmp_path: Path) -> None:
    # The handler is called service.py and imports a sibling called errors.py: both names
    # exist in the backend package too.
    model_dir = model_dir_with(
        tmp_path,
        files={
            "errors.py": "GREETING = b'hello from the archive'\n",
            "service.py": """
                import errors

                def handle(data, context):
                    return None if data is None else [errors.GREETING] * len(data)
            """,
        },
    )
    service = load_service(load_message(model_dir, "service.py"))

    assert service.predict(bodies([b"x"])).responses[0].body == b"hello from the archive"
    assert sys.modules["backend.service.model_service"].ModelService is ModelService


def test_dependency_dirs_are_importable_ahead_of_the_server_packages(tmp_path: Path) -> None:
    # What `pip install --target` leaves: packages, and .pth files naming more folders.
    deps = tmp_path / "site-packages"
    (deps / "tinydep").mkdir(parents=True)
    (deps / "tinydep" / "__init__.py").write_text("ANSWER = b'from its own package'\n")
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "extradep.py").write_text("SUFFIX = b'!'\n")
    (deps / "extra.pth").write_text(f"{tmp_path / 'extra'}\n")
    model_dir = model_dir_with(tmp_path, files={"uses.py": """
        import extradep
        import tinydep

        def handle(data, context):
            return None if data is None else [tinydep.ANSWER + extradep.SUFFIX] * len(data)
    """})
    service = load_service(load_message(model_dir, "uses.py", dependency_dirs=[str(deps)]))

    assert service.predict(bodies([b"x"])).responses[0].body == b"from its own package!"
    server_packages = next(entry for entry in sys.path if entry.endswith("site-packages")
                           and entry != str(deps))
    assert sys.path.index(str(deps)) < sys.path.index(server_packages)


def test_context_carries_torchserve_properties(tmp_path: Path) -> None:
    manifest = {"model": {"modelName": "toy", "handler": "echo.py", "configFile": "cfg.yaml"}}
    model_dir = model_dir_with(
        tmp_path, "echo.py", files={"cfg.yaml": "minWorkers: 1\nhandler:\n  topk: 3\n"}
    )
    service = load_service(
        load_message(
            model_dir,
            "echo.py",
            manifest_json=json.dumps(manifest),
            gpu_id=-1,
            batch_size=8,
            server_version="9.9",
        )
    )
    context = service.context

    assert context.model_name == "toy"
    assert context.manifest == manifest
    assert context.model_yaml_config == {"minWorkers": 1, "handler": {"topk": 3}}
    assert context.system_properties == {
        "model_dir": str(model_dir),
        "gpu_id": None,
        "cpu_threads": None,
        "batch_size": 8,
        "server_name": "MMS",
        "server_version": "9.9",
        "limit_max_image_pixels": True,
    }

    result = service.predict(
        batch(
            request(
                b"x", request_id="id-1", headers={"TS_Request_Sequence_Id": "seq-9", "X-A": "1"}
            )
        )
    )
    assert context.get_request_id() == "id-1"
    assert context.get_request_header(0, "x-a") == "1"
    assert context.get_all_request_header(0) == {"TS_Request_Sequence_Id": "seq-9", "X-A": "1"}
    assert context.get_sequence_id(0) == "seq-9"
    assert (context.header_key_sequence_id, context.header_key_sequence_start,
            context.header_key_sequence_end) == (
        "ts_request_sequence_id", "ts_request_sequence_start", "ts_request_sequence_end")
    assert context.get_response_status(0) == (200, "")
    context.set_all_response_status(503, "Busy")
    assert context.get_response_status(0) == (503, "Busy")
    # The batch's metrics travel with its result (and leave the context), labelled as
    # TorchServe's worker labels them.
    [prediction_time] = result.metrics
    assert (prediction_time.name, prediction_time.unit, prediction_time.type) == (
        "PredictionTime", "Milliseconds", "gauge")
    assert list(prediction_time.dimension_names) == ["ModelName", "Level"]
    assert list(prediction_time.dimension_values) == [context.model_name, "Model"]
    assert prediction_time.request_id == "id-1"
    assert service.drain_metrics() == []


def test_gpu_id_is_passed_when_set(tmp_path: Path) -> None:
    service = load(tmp_path, "echo.py", "echo.py", gpu_id=1)

    assert service.context.system_properties["gpu_id"] == 1


def test_context_constructor_is_torchserve_compatible(tmp_path: Path) -> None:
    context = Context("m", str(tmp_path), {"model": {}}, 2, 0, "0.12.0")

    assert context.system_properties["gpu_id"] == 0
    assert context.model_yaml_config == {}
    context.metrics.add_counter("Hits", 1, idx=None, dimensions=["a:b"])
    context.metrics.add_time("Took", 5.5)
    # Outside a batch there is no request: TorchServe's Level:Error dimension.
    assert [(m.name, m.value, m.unit, list(m.dimension_names), list(m.dimension_values))
            for m in context.metrics.sink.drain()] == [
        ("Hits", 1.0, "Count", ["a", "Level"], ["b", "Error"]),
        ("Took", 5.5, "Milliseconds", ["Level"], ["Error"]),
    ]
    assert len(context.metrics.sink) == 0


# --- failures of the whole batch -------------------------------------------------------------


def test_wrong_number_of_results_is_a_batch_size_mismatch(tmp_path: Path) -> None:
    service = load(tmp_path, "wrong_length.py", "wrong_length.py")

    with pytest.raises(BatchSizeMismatch) as caught:
        service.predict(bodies([b"a"]))

    assert classify(caught.value) == (
        worker_pb2.BATCH_SIZE_MISMATCH,
        "wrong_length.py:handle returned 2 results for a batch of 1 requests",
    )
    # In a batch of several, every request is tried alone, and fails alone.
    result = service.predict(bodies([b"a", b"b"]))
    assert [r.error for r in result.responses] == [
        "wrong_length.py:handle returned 2 results for a batch of 1 requests"] * 2


def test_output_that_is_not_a_list_is_rejected(tmp_path: Path) -> None:
    model_dir = model_dir_with(
        tmp_path,
        files={
            "scalar.py": "def handle(data, context):\n    return None if data is None else 42\n"
        },
    )
    service = load_service(load_message(model_dir, "scalar.py"))

    with pytest.raises(InvalidHandlerOutput) as caught:
        service.predict(bodies([b"a"]))

    code, message = classify(caught.value)
    assert code == worker_pb2.INTERNAL
    assert message == (
        "InvalidHandlerOutput: scalar.py:handle returned int, expected a list of 1 results"
    )


def test_handler_exception_maps_to_internal_with_type_and_message(tmp_path: Path) -> None:
    service = load(tmp_path, "raises.py", "raises.py")

    with pytest.raises(RuntimeError) as caught:
        service.predict(bodies([b"a"]))

    assert classify(caught.value) == (worker_pb2.INTERNAL, "RuntimeError: boom")


def test_invalid_input_and_out_of_memory_have_their_own_codes(tmp_path: Path) -> None:
    service = load(tmp_path, "raises.py", "raises.py")

    with pytest.raises(InvalidInput) as invalid:
        service.predict(bodies([b"invalid"]))
    with pytest.raises(MemoryError) as oom:
        service.predict(bodies([b"oom"]))

    assert classify(invalid.value) == (
        worker_pb2.INVALID_INPUT,
        "the input is not a picture of a cat",
    )
    assert classify(oom.value) == (
        worker_pb2.OUT_OF_MEMORY,
        "MemoryError: pretend the host ran out of memory",
    )


def test_torchserve_prediction_exception_keeps_its_status(tmp_path: Path) -> None:
    model_dir = model_dir_with(
        tmp_path,
        files={
            "ts_style.py": """
                class PredictionException(Exception):
                    def __init__(self, message, error_code=500):
                        super().__init__(message)
                        self.message = message
                        self.error_code = error_code

                def handle(data, context):
                    if data is None:
                        return None
                    raise PredictionException("model is warming up", 513)
            """
        },
    )
    service = load_service(load_message(model_dir, "ts_style.py"))

    result = service.predict(bodies([b"a", b"b"]))

    for response in result.responses:
        assert (response.status, response.error, response.error_type) == (
            513,
            "model is warming up",
            "PredictionException",
        )
        assert response.body == b""


# --- failures of single requests -------------------------------------------------------------


def test_exception_items_fail_only_their_own_request(tmp_path: Path) -> None:
    service = load(tmp_path, "per_request_error.py", "per_request_error.py")

    result = service.predict(bodies([b"fine", b"invalid", b"teapot", b"crash", b"also fine"]))

    fine, invalid, teapot, crash, also_fine = result.responses
    assert (fine.status, fine.body, fine.error) == (200, b"fine", "")
    assert (also_fine.status, also_fine.body) == (200, b"also fine")
    assert (invalid.status, invalid.error_type, invalid.error) == (
        400,
        "InvalidInput",
        "cannot use 'invalid'",
    )
    # A handler's own exception names its class in the message (the client's error body
    # gets TorchServe's type name for the status, not the handler's class).
    assert (teapot.status, teapot.error_type, teapot.error) == (
        418, "TeapotError", "TeapotError: I'm a teapot")
    assert (crash.status, crash.error_type, crash.error) == (
        500,
        "RuntimeError",
        "RuntimeError: this one request crashed",
    )
    assert [r.request_id for r in result.responses] == ["r0", "r1", "r2", "r3", "r4"]


def test_unserialisable_item_fails_only_its_request(tmp_path: Path) -> None:
    model_dir = model_dir_with(
        tmp_path,
        files={
            "odd.py": "def handle(data, context):\n"
            "    return None if data is None else [{'ok': 1}, {1, 2}]\n"
        },
    )
    service = load_service(load_message(model_dir, "odd.py"))

    good, bad = service.predict(bodies([b"a", b"b"])).responses

    assert (good.status, json.loads(good.body)) == (200, {"ok": 1})
    assert (bad.status, bad.error_type) == (500, "TypeError")
    assert "not JSON serializable" in bad.error


# --- load errors -----------------------------------------------------------------------------


def test_missing_handler_file(tmp_path: Path) -> None:
    with pytest.raises(HandlerLoadError, match=r"no file 'nope.py' in .*model"):
        load(tmp_path, "nope.py")


def test_unknown_builtin_name(tmp_path: Path) -> None:
    with pytest.raises(HandlerLoadError, match="no built-in handler of that name"):
        load(tmp_path, "not_a_builtin")


def test_missing_model_dir(tmp_path: Path) -> None:
    with pytest.raises(HandlerLoadError, match="does not exist"):
        load_service(load_message(tmp_path / "absent", "echo.py"))


def test_two_handler_classes(tmp_path: Path) -> None:
    model_dir = model_dir_with(
        tmp_path,
        files={
            "two.py": """
                class First:
                    def handle(self, data, context):
                        return data

                class Second:
                    def handle(self, data, context):
                        return data
            """
        },
    )
    with pytest.raises(
        HandlerLoadError, match=r"two.py defines 2 handler classes \(First, Second\)"
    ):
        load_service(load_message(model_dir, "two.py"))


def test_subclass_in_the_same_file_is_the_handler(tmp_path: Path) -> None:
    model_dir = model_dir_with(
        tmp_path,
        files={
            "derived.py": """
                class Base:
                    def handle(self, data, context):
                        return [b"base"] * len(data)

                class Derived(Base):
                    def handle(self, data, context):
                        return [b"derived"] * len(data)
            """
        },
    )
    service = load_service(load_message(model_dir, "derived.py"))

    assert service.predict(bodies([b"x"])).responses[0].body == b"derived"


def test_import_error_names_the_cause(tmp_path: Path) -> None:
    model_dir = model_dir_with(tmp_path, files={"broken.py": "import not_a_real_module_xyz\n"})

    with pytest.raises(HandlerLoadError) as caught:
        load_service(load_message(model_dir, "broken.py"))

    assert str(caught.value) == (
        "cannot import handler broken.py: ModuleNotFoundError: No module named "
        "'not_a_real_module_xyz'"
    )
    # Handler modules get names like _batchserve_handler_3_broken (torch has modules with
    # "broken" in their names, so look only at handler modules).
    assert not any(
        name.startswith("_batchserve_handler_") and name.endswith("broken") for name in sys.modules
    )


def test_syntax_error_is_a_load_error(tmp_path: Path) -> None:
    model_dir = model_dir_with(tmp_path, files={"bad_syntax.py": "def handle(:\n"})

    with pytest.raises(
        HandlerLoadError, match=r"cannot import handler bad_syntax\.py: SyntaxError"
    ):
        load_service(load_message(model_dir, "bad_syntax.py"))


def test_module_without_handle_or_class(tmp_path: Path) -> None:
    model_dir = model_dir_with(tmp_path, files={"empty.py": "VALUE = 1\n"})

    with pytest.raises(HandlerLoadError, match="defines neither a function handle"):
        load_service(load_message(model_dir, "empty.py"))


def test_class_without_handle_method(tmp_path: Path) -> None:
    model_dir = model_dir_with(tmp_path, files={"nohandle.py": "class Model:\n    pass\n"})

    with pytest.raises(HandlerLoadError, match=r"none of its classes \(Model\) has a handle"):
        load_service(load_message(model_dir, "nohandle.py"))


def test_missing_named_function(tmp_path: Path) -> None:
    with pytest.raises(HandlerLoadError, match=r"echo\.py has no function 'predict'"):
        load(tmp_path, "echo.py:predict", "echo.py")


def test_initialize_failure_propagates_with_its_type(tmp_path: Path) -> None:
    model_dir = model_dir_with(
        tmp_path,
        files={
            "needs_weights.py": """
                class Handler:
                    def initialize(self, context):
                        raise FileNotFoundError("model.pt is missing")

                    def handle(self, data, context):
                        return data
            """
        },
    )
    with pytest.raises(FileNotFoundError, match=r"model\.pt is missing"):
        load_service(load_message(model_dir, "needs_weights.py"))


# --- a batch that fails as a whole ----------------------------------------------------------


ISOLATING = """
    import time

    calls = []

    def handle(data, context):
        if data is None:
            return None
        bodies = [row["body"] for row in data]
        calls.append(len(bodies))
        bad = [b for b in bodies if b.startswith(b"bad")]
        if bad:
            time.sleep(0.002)  # failing takes a moment: the time cap's test counts on it
            raise ValueError(f"cannot read {bad[0].decode()}")
        return [b.upper() for b in bodies]
"""


def _isolating(tmp_path: Path, response_timeout_ms: int = 120_000) -> ModelService:
    model_dir = model_dir_with(tmp_path, files={"isolating.py": ISOLATING})
    return load_service(load_message(model_dir, "isolating.py",
                                     response_timeout_ms=response_timeout_ms))


def _calls(service: ModelService) -> list[int]:
    return sys.modules[service.entry_point.handle.__module__].calls  # type: ignore[no-any-return]


def test_a_batch_failed_by_one_request_answers_the_others(tmp_path: Path) -> None:
    service = _isolating(tmp_path)
    batch = bodies([b"a", b"b", b"bad1", b"c", b"d", b"e", b"f", b"g"])

    result = service.predict(batch)

    assert [r.body for r in result.responses] == [b"A", b"B", b"", b"C", b"D", b"E", b"F", b"G"]
    assert [r.status for r in result.responses if r.error] == [500]
    assert result.responses[2].error == "ValueError: cannot read bad1"
    assert [r.request_id for r in result.responses] == [r.request_id for r in batch.requests]
    # The whole batch, then halves, quarters and singles down the failing side only.
    assert _calls(service) == [8, 4, 4, 2, 2, 1, 1]


def test_several_bad_requests_are_each_found_within_the_cap(tmp_path: Path) -> None:
    service = _isolating(tmp_path)

    result = service.predict(bodies([b"bad1", b"a", b"b", b"bad2"]))

    assert [r.error or r.body.decode() for r in result.responses] == [
        "ValueError: cannot read bad1", "A", "B", "ValueError: cannot read bad2"]
    assert sum(_calls(service)[1:]) <= 3 * 4  # re-runs add up to at most 3 batches


def test_when_every_request_fails_the_extra_work_is_capped(tmp_path: Path) -> None:
    service = _isolating(tmp_path)

    result = service.predict(bodies([b"bad%d" % i for i in range(16)]))

    assert all(r.error.startswith("ValueError: cannot read bad") for r in result.responses)
    assert sum(_calls(service)[1:]) <= 3 * 16  # not the 4 * 16 of a complete search


def test_no_isolation_past_its_share_of_the_response_timeout(tmp_path: Path) -> None:
    service = _isolating(tmp_path, response_timeout_ms=1)

    result = service.predict(bodies([b"a", b"bad1"]))

    # No time left to re-run anything: both requests carry the batch's error.
    assert [r.error for r in result.responses] == ["ValueError: cannot read bad1"] * 2
    assert _calls(service) == [2]


def test_a_stateful_batch_is_never_re_run(tmp_path: Path) -> None:
    service = _isolating(tmp_path)
    batch = bodies([b"a", b"bad1"])
    for index, sequence_request in enumerate(batch.requests):
        sequence_request.headers["ts_request_sequence_id"] = f"seq-{index}"

    # Re-running "a" would count it twice in its sequence's state: the batch fails whole.
    with pytest.raises(ValueError, match="cannot read bad1"):
        service.predict(batch)
    assert _calls(service) == [2]


# --- where the handler's time went (backend/service/phases.py) ------------------------------


def test_a_handler_with_steps_reports_each_steps_time(tmp_path: Path) -> None:
    service = load(tmp_path, "phased.py", "phased.py")

    result = service.predict(bodies([b"a", b"b"]))

    assert [r.body for r in result.responses] == [b"a", b"b"]
    phases = result.phases
    assert phases.steps
    assert phases.preprocess_ms >= 20 and phases.inference_ms >= 60
    assert phases.postprocess_ms >= 30
    steps_ms = phases.preprocess_ms + phases.inference_ms + phases.postprocess_ms
    assert steps_ms <= result.handler_time_ms


def test_a_function_handler_reports_its_whole_time_as_inference(tmp_path: Path) -> None:
    service = load(tmp_path, "echo.py", "echo.py")

    result = service.predict(bodies([b"a"]))

    assert not result.phases.steps
    assert result.phases.inference_ms == result.handler_time_ms
    assert result.phases.preprocess_ms == result.phases.postprocess_ms == 0.0
