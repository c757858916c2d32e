"""frontend/errors.py: each client-visible error's status and type, the worker's error codes,
and the renderings (TorchServe and KServe bodies, HTTP header pairs, gRPC codes)."""

from __future__ import annotations

import json

import grpc
import pytest

from frontend import errors
from frontend.errors import (
    GRPC_CODES,
    ArchiveError,
    BadRequest,
    Conflict,
    DependencyInstallError,
    Forbidden,
    GatewayTimeout,
    HeaderFieldsTooLarge,
    InternalError,
    InvalidDag,
    InvalidWorkflow,
    MethodNotAllowed,
    ModelNotFound,
    ModelVersionNotFound,
    NotFound,
    NotImplementedByModel,
    OutOfResources,
    PayloadTooLarge,
    QueueFull,
    RequestHeadTimeout,
    RouteNotFound,
    SequenceLost,
    SequenceRefused,
    ServeError,
    ServiceUnavailable,
    TooManyWorkers,
    Unauthorized,
    UriTooLong,
    WorkerDied,
    WorkerError,
    WorkflowFailed,
    WorkflowNotFound,
    error_body,
    expired,
    grpc_code,
    header_pairs,
    kserve_body,
    torchserve_body,
    type_for_status,
    worker_error,
)
from protos import worker_pb2

#: Every ServeError class but WorkerError (whose status comes from the worker): its HTTP
#: status and TorchServe's type name.
STATUS_AND_TYPE: dict[type[ServeError], tuple[int, str]] = {
    ServeError: (500, "InternalServerException"),
    BadRequest: (400, "BadRequestException"),
    # More workers than max_workers_per_model/_per_server allow: a bad request (TorchServe
    # has no such cap).
    TooManyWorkers: (400, "BadRequestException"),
    ArchiveError: (400, "ModelArchiveException"),
    DependencyInstallError: (400, "ModelException"),
    Unauthorized: (401, "InvalidKeyException"),
    Forbidden: (403, "ForbiddenException"),
    NotFound: (404, "ResourceNotFoundException"),
    RouteNotFound: (404, "ResourceNotFoundException"),
    ModelNotFound: (404, "ModelNotFoundException"),
    ModelVersionNotFound: (404, "ModelVersionNotFoundException"),
    WorkflowNotFound: (404, "WorkflowNotFoundException"),
    InvalidWorkflow: (400, "InvalidWorkflowException"),
    InvalidDag: (400, "InvalidDAGException"),
    WorkflowFailed: (500, "WorkflowException"),
    MethodNotAllowed: (405, "MethodNotAllowedException"),
    RequestHeadTimeout: (408, "RequestTimeoutException"),
    Conflict: (409, "ConflictStatusException"),
    PayloadTooLarge: (413, "PayloadTooLargeException"),
    UriTooLong: (414, "RequestUriTooLongException"),
    HeaderFieldsTooLarge: (431, "RequestHeaderFieldsTooLargeException"),
    InternalError: (500, "InternalServerException"),
    WorkerDied: (500, "InternalServerException"),
    # TorchServe has no name for 501 (it calls every failure a handler reports
    # InternalServerException); an explanation a model cannot give is named for what it is.
    NotImplementedByModel: (501, "NotImplementedException"),
    ServiceUnavailable: (503, "ServiceUnavailableException"),
    QueueFull: (503, "ServiceUnavailableException"),
    SequenceRefused: (503, "ServiceUnavailableException"),
    SequenceLost: (500, "InternalServerException"),
    GatewayTimeout: (504, "RequestTimeoutException"),
    OutOfResources: (507, "OutOfResourcesException"),
}


def _subclasses(cls: type[ServeError]) -> set[type[ServeError]]:
    found = set()
    for sub in cls.__subclasses__():
        if sub.__module__ == errors.__name__:  # tests may define their own
            found |= {sub, *_subclasses(sub)}
    return found


def _instance(cls: type[ServeError]) -> ServeError:
    if cls is WorkerError:
        return WorkerError(507, "OutOfResourcesException", "oom")
    if cls in (RouteNotFound, MethodNotAllowed):
        return cls()
    if cls is QueueFull:
        return QueueFull(100)
    return cls("what went wrong")


def test_the_table_names_every_error_class() -> None:
    # A new error class must state its status and type here (and so in GRPC_CODES' check).
    assert _subclasses(ServeError) - {WorkerError} == set(STATUS_AND_TYPE) - {ServeError}


@pytest.mark.parametrize(("cls", "expected"), STATUS_AND_TYPE.items(),
                         ids=[cls.__name__ for cls in STATUS_AND_TYPE])
def test_each_error_states_its_status_and_torchserve_type(
        cls: type[ServeError], expected: tuple[int, str]) -> None:
    error = _instance(cls)
    assert (error.http_status, error.type_name) == expected
    assert json.loads(error_body(error)) == {"code": expected[0], "type": expected[1],
                                             "message": error.message}


def test_an_error_has_its_own_headers_and_none_by_default() -> None:
    plain, other = ServiceUnavailable("a"), ServiceUnavailable("b")
    plain.headers["X-Mine"] = "1"
    assert other.headers == {}, "errors must not share one headers dict"
    retry = ServiceUnavailable("full", headers={"Retry-After": "1"})
    assert retry.headers == {"Retry-After": "1"}
    assert retry.message == str(retry) == "full"


def test_route_not_found_is_a_not_found_with_torchserve_message() -> None:
    error = RouteNotFound()
    assert isinstance(error, NotFound)
    assert error.message == "Requested resource is not found, please refer to API document."


def test_method_not_allowed_has_torchserve_default_message() -> None:
    assert MethodNotAllowed().message == \
        "Requested method is not allowed, please refer to API document."
    assert MethodNotAllowed("Model API is disabled").message == "Model API is disabled"


@pytest.mark.parametrize(("code", "status", "type_name"), [
    (worker_pb2.INVALID_INPUT, 400, "InvalidInputException"),
    (worker_pb2.OUT_OF_MEMORY, 507, "OutOfResourcesException"),
    (worker_pb2.BATCH_SIZE_MISMATCH, 500, "InternalServerException"),
    (worker_pb2.INTERNAL, 500, "InternalServerException"),
    (worker_pb2.LOAD_FAILED, 500, "InternalServerException"),
    (worker_pb2.ERROR_CODE_UNSPECIFIED, 500, "InternalServerException"),
    (987, 500, "InternalServerException"),  # a code from a newer worker
])
def test_worker_error_codes_map_to_status_and_type(code: int, status: int,
                                                   type_name: str) -> None:
    error = worker_error(code, "CUDA out of memory")
    assert isinstance(error, ServeError)
    assert (error.http_status, error.type_name) == (status, type_name)
    assert error.message == "Prediction failed: CUDA out of memory"
    assert json.loads(error_body(error))["code"] == status


def test_worker_errors_do_not_change_their_class_defaults() -> None:
    worker_error(worker_pb2.OUT_OF_MEMORY, "oom")
    assert (WorkerError.http_status, WorkerError.type_name) == (500, "InternalServerException")


@pytest.mark.parametrize(("status", "type_name"), [
    (400, "InvalidInputException"),
    (401, "InvalidKeyException"),
    (403, "ForbiddenException"),
    (404, "ResourceNotFoundException"),
    (405, "MethodNotAllowedException"),
    (408, "RequestTimeoutException"),
    (409, "ConflictStatusException"),
    (413, "PayloadTooLargeException"),
    (500, "InternalServerException"),
    (501, "NotImplementedException"),
    (503, "ServiceUnavailableException"),
    (504, "RequestTimeoutException"),
    (507, "OutOfResourcesException"),
    # not in the table: by class of status
    (418, "BadRequestException"),
    (422, "BadRequestException"),
    (499, "BadRequestException"),
    (502, "InternalServerException"),
    (599, "InternalServerException"),
])
def test_type_for_status(status: int, type_name: str) -> None:
    assert type_for_status(status) == type_name


def test_type_for_status_only_ever_names_torchserve_types() -> None:
    # A handler picks the status of its per-request failure, never the type: whatever status
    # it picks, the type is one of the table's names (its own class stays in the message).
    known = {type_name for _, type_name in STATUS_AND_TYPE.values()} | {"InvalidInputException"}
    assert {type_for_status(status) for status in range(400, 600)} <= known


def test_torchserve_body_is_two_space_json_with_a_trailing_newline() -> None:
    assert torchserve_body(404, "ModelNotFoundException", "Model not found: x") == (
        b'{\n  "code": 404,\n  "type": "ModelNotFoundException",\n'
        b'  "message": "Model not found: x"\n}\n')


def test_torchserve_body_carries_any_message_text() -> None:
    message = 'caf\u00e9 "quoted"\nsecond line'
    body = torchserve_body(400, "BadRequestException", message)
    assert json.loads(body) == {"code": 400, "type": "BadRequestException", "message": message}


def test_error_body_renders_the_error() -> None:
    error = ModelVersionNotFound("Model version 9 does not exist for model m")
    assert error_body(error) == torchserve_body(404, "ModelVersionNotFoundException",
                                                "Model version 9 does not exist for model m")
    failed = worker_error(worker_pb2.INVALID_INPUT, "bad image")
    assert json.loads(error_body(failed)) == {
        "code": 400, "type": "InvalidInputException", "message": "Prediction failed: bad image"}


def test_kserve_body() -> None:
    assert kserve_body("Model m is not ready") == b'{"error": "Model m is not ready"}'
    assert json.loads(kserve_body('a "b"\n')) == {"error": 'a "b"\n'}


def test_header_pairs_are_lower_case_latin_1() -> None:
    error = ServiceUnavailable("full", headers={"Retry-After": "1", "X-Note": "caf\u00e9"})
    assert header_pairs(error) == [(b"retry-after", b"1"), (b"x-note", b"caf\xe9")]
    assert header_pairs(BadRequest("no headers")) == []


@pytest.mark.parametrize(("status", "code"), [
    (400, grpc.StatusCode.INVALID_ARGUMENT),
    (401, grpc.StatusCode.UNAUTHENTICATED),
    (403, grpc.StatusCode.PERMISSION_DENIED),
    (404, grpc.StatusCode.NOT_FOUND),
    (405, grpc.StatusCode.PERMISSION_DENIED),
    (408, grpc.StatusCode.DEADLINE_EXCEEDED),
    (409, grpc.StatusCode.ALREADY_EXISTS),
    (413, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (501, grpc.StatusCode.UNIMPLEMENTED),
    (503, grpc.StatusCode.UNAVAILABLE),
    (504, grpc.StatusCode.DEADLINE_EXCEEDED),
    (507, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (500, grpc.StatusCode.INTERNAL),
    (418, grpc.StatusCode.INTERNAL),
    (200, grpc.StatusCode.INTERNAL),
])
def test_grpc_code(status: int, code: grpc.StatusCode) -> None:
    assert grpc_code(status) is code


def test_every_mapped_error_class_has_a_specific_grpc_code() -> None:
    for cls in (*STATUS_AND_TYPE, WorkerError):
        status = _instance(cls).http_status
        if status in GRPC_CODES:
            assert grpc_code(status) is not grpc.StatusCode.INTERNAL, cls.__name__


def test_only_500s_and_http_only_errors_fall_back_to_internal() -> None:
    # 414 and 431 describe an HTTP request line and headers: gRPC never raises them.
    unmapped = {cls for cls in STATUS_AND_TYPE if _instance(cls).http_status not in GRPC_CODES}
    assert {cls for cls in unmapped if _instance(cls).http_status != 500} == {
        UriTooLong, HeaderFieldsTooLarge}


def test_a_full_queue_says_so_and_when_to_retry() -> None:
    error = QueueFull(7)
    assert isinstance(error, ServiceUnavailable)
    assert error.message == "job queue is full (7 requests waiting); retry later"
    assert error.headers == {"Retry-After": "1"}


@pytest.mark.parametrize(("dispatched", "where"), [
    (False, "in the queue, before a worker was free"), (True, "in a worker")])
def test_an_expired_request_says_where_it_waited(dispatched: bool, where: str) -> None:
    error = expired(2.5, dispatched)
    assert (error.http_status, error.type_name) == (504, "RequestTimeoutException")
    assert error.message == f"no answer within 2.5 s: the request timed out {where}"
