"""Every error a client can see, and the one place that maps and renders them.

* Each ``ServeError`` class states its HTTP status and TorchServe's exception type name once.
* ``worker_error`` maps a worker's ``ErrorCode`` (a whole batch failed) to the error its
  requests get; ``type_for_status`` names a worker's per-request failure (a ``Response`` with
  ``error`` and a status) by TorchServe's type for that status, never by the handler's own
  exception class (which stays in the message).
* The renderings, one per protocol: ``torchserve_body`` (TorchServe's ``{"code", "type",
  "message"}``), ``kserve_body`` (KServe v1/v2's ``{"error": ...}``), ``grpc_code`` (the gRPC
  status for an HTTP status), and ``header_pairs`` (an error's own headers, e.g.
  ``Retry-After``, as HTTP header pairs).
* What a message may quote of client input: ``quoted`` (as ``!r`` shows it) and ``excerpt``
  (unquoted, as TorchServe's messages name things), each at most ``MAX_QUOTED_CHARS``
  characters of it, escaped (``model_archiver.quoting``, which the archivers' messages use
  too). Every message that quotes a name, URL, parameter, header or file a client sent goes
  through one of them; and, should one be missed, no error message is longer than
  ``MAX_MESSAGE_CHARS``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from model_archiver.quoting import MAX_QUOTED_CHARS as MAX_QUOTED_CHARS
from model_archiver.quoting import excerpt as excerpt
from model_archiver.quoting import quoted as quoted
from protos import worker_pb2

if TYPE_CHECKING:
    import grpc


#: The longest error message a client is sent (the rest is cut, saying how long it was): a
#: last bound for a message that quotes client input without ``quoted``/``excerpt``.
MAX_MESSAGE_CHARS = 8192


class ServeError(Exception):
    """Base of every client-visible error: a message, an HTTP status, TorchServe's type name."""

    #: The HTTP status; gRPC's code follows from it (``grpc_code``).
    http_status: int = 500
    #: The "type" field of the error body; TorchServe clients sometimes match on it.
    type_name: str = "InternalServerException"
    headers: dict[str, str]

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = (f"{message[:MAX_MESSAGE_CHARS]}... (cut: the message was "
                       f"{len(message)} characters)")
        super().__init__(message)
        self.headers = headers or {}

    @property
    def message(self) -> str:
        return str(self)


class BadRequest(ServeError):
    http_status = 400
    type_name = "BadRequestException"


class Unauthorized(ServeError):
    """A missing, wrong or expired token (TorchServe answers 400; 401 is the right code)."""

    http_status = 401
    type_name = "InvalidKeyException"


class Forbidden(ServeError):
    http_status = 403
    type_name = "ForbiddenException"


class NotFound(ServeError):
    http_status = 404
    type_name = "ResourceNotFoundException"


class RouteNotFound(NotFound):
    """No route of an API serves this path (a listener serving several APIs tries the next)."""

    def __init__(self) -> None:
        super().__init__("Requested resource is not found, please refer to API document.")


class ModelNotFound(NotFound):
    type_name = "ModelNotFoundException"


class ModelVersionNotFound(NotFound):
    type_name = "ModelVersionNotFoundException"


class WorkflowNotFound(NotFound):
    type_name = "WorkflowNotFoundException"


class MethodNotAllowed(ServeError):
    http_status = 405
    type_name = "MethodNotAllowedException"

    def __init__(self, message: str = "Requested method is not allowed, please refer to API "
                 "document.") -> None:
        super().__init__(message)


class RequestHeadTimeout(ServeError):
    """A request's head (line and headers) did not arrive within request_header_timeout."""

    http_status = 408
    type_name = "RequestTimeoutException"


class Conflict(ServeError):
    http_status = 409
    type_name = "ConflictStatusException"


class PayloadTooLarge(ServeError):
    http_status = 413
    type_name = "PayloadTooLargeException"


class UriTooLong(ServeError):
    http_status = 414
    type_name = "RequestUriTooLongException"


class HeaderFieldsTooLarge(ServeError):
    http_status = 431
    type_name = "RequestHeaderFieldsTooLargeException"


class InternalError(ServeError):
    pass


class WorkerDied(InternalError):
    """The worker process exited or its socket broke while it held requests."""


class NotImplementedByModel(ServeError):
    """The model cannot do what was asked: an explanation from a handler with no explanation
    path, or where Captum is not installed (the worker answers such requests 501)."""

    http_status = 501
    type_name = "NotImplementedException"


class ServiceUnavailable(ServeError):
    http_status = 503
    type_name = "ServiceUnavailableException"


class QueueFull(ServiceUnavailable):
    """The model's job queue is full (``job_queue_size``): refused at once; retry later."""

    def __init__(self, capacity: int) -> None:
        super().__init__(f"job queue is full ({capacity} requests waiting); retry later",
                         headers={"Retry-After": "1"})


class SequenceRefused(ServiceUnavailable):
    """A stateful model cannot take this request of a sequence now: maxNumSequence sequences
    are open, the sequence's own queue is full (maxSequenceJobQueueSize), or it is closing.
    503, as TorchServe answers."""


class SequenceLost(InternalError):
    """A sequence ended because its worker died or was stopped: its state is gone, so its
    waiting requests (and, for a while, later ones naming it) are refused rather than run
    without it."""


class OutOfResources(ServeError):
    http_status = 507
    type_name = "OutOfResourcesException"


class GatewayTimeout(ServeError):
    """The worker did not answer within the model's response_timeout."""

    http_status = 504
    type_name = "RequestTimeoutException"


def expired(budget_s: float, dispatched: bool) -> GatewayTimeout:
    """The 504 of a request whose deadline passed, the same text whoever notices first (the
    plane's timer, or the batcher while the request still waits in its queue)."""
    where = "in a worker" if dispatched else "in the queue, before a worker was free"
    return GatewayTimeout(f"no answer within {budget_s:g} s: the request timed out {where}")


class ConfigError(Exception):
    """A configuration value is invalid; raised at startup, names the key."""


class TooManyWorkers(BadRequest):
    """A registration or scale asks for more workers than ``max_workers_per_model`` or
    ``max_workers_per_server`` allow (frontend/serving/capacity.py)."""


class ArchiveError(BadRequest):
    """A model archive is missing, malformed, unsafe or not allowed."""

    type_name = "ModelArchiveException"


class DependencyInstallError(BadRequest):
    """A model's own Python packages (its archive's requirements file, its venv) could not
    be installed at registration (TorchServe: 400 ModelException)."""

    type_name = "ModelException"


class InvalidWorkflow(BadRequest):
    """A workflow archive (.war) whose manifest, spec or handler cannot be used (TorchServe:
    500 InvalidWorkflowException; a bad archive is the client's error here)."""

    type_name = "InvalidWorkflowException"


class InvalidDag(BadRequest):
    """A workflow spec's ``dag`` is not one DAG with a single start node (TorchServe: 400)."""

    type_name = "InvalidDAGException"


class WorkflowFailed(InternalError):
    """A node of a workflow could not be registered (the workflow is rolled back), as
    TorchServe answers it: 500 WorkflowException."""

    type_name = "WorkflowException"


# ---- what a worker reports ------------------------------------------------------------------


class WorkerError(ServeError):
    """A worker failed a whole batch: status and type come from its ErrorCode."""

    def __init__(self, status: int, type_name: str, message: str) -> None:
        super().__init__(message)
        self.http_status = status
        self.type_name = type_name


#: A worker's ErrorCode (the whole batch failed) -> the status and type its requests get.
WORKER_ERRORS: dict[int, tuple[int, str]] = {
    worker_pb2.INVALID_INPUT: (400, "InvalidInputException"),
    worker_pb2.OUT_OF_MEMORY: (507, OutOfResources.type_name),
    worker_pb2.BATCH_SIZE_MISMATCH: (500, InternalError.type_name),
}


def worker_error(code: int, message: str) -> ServeError:
    """The error each request of a batch the worker failed with ``code`` gets."""
    status, type_name = WORKER_ERRORS.get(code, (500, InternalError.type_name))
    return WorkerError(status, type_name, f"Prediction failed: {message}")


#: TorchServe's exception type name for the status of a request a worker failed on its own.
_TYPES_BY_STATUS = {
    400: "InvalidInputException",
    401: Unauthorized.type_name,
    403: Forbidden.type_name,
    404: NotFound.type_name,
    405: MethodNotAllowed.type_name,
    408: RequestHeadTimeout.type_name,
    409: Conflict.type_name,
    413: PayloadTooLarge.type_name,
    500: InternalError.type_name,
    501: NotImplementedByModel.type_name,
    503: ServiceUnavailable.type_name,
    504: GatewayTimeout.type_name,
    507: OutOfResources.type_name,
}


def type_for_status(status: int) -> str:
    """The type name of a per-request failure with this status (a handler may pick any)."""
    known = _TYPES_BY_STATUS.get(status)
    if known is not None:
        return known
    return BadRequest.type_name if 400 <= status < 500 else InternalError.type_name


# ---- renderings, one per protocol -----------------------------------------------------------


def torchserve_body(status: int, type_name: str, message: str) -> bytes:
    """TorchServe's error body: two-space indented JSON with a trailing newline."""
    return (json.dumps({"code": status, "type": type_name, "message": message}, indent=2)
            + "\n").encode()


def error_body(error: ServeError) -> bytes:
    return torchserve_body(error.http_status, error.type_name, error.message)


def kserve_body(message: str) -> bytes:
    """KServe v1 and v2's error body."""
    return json.dumps({"error": message}).encode()


def header_pairs(error: ServeError) -> list[tuple[bytes, bytes]]:
    """An error's own headers (Retry-After, ...) as lower-case HTTP header pairs."""
    return [(name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in error.headers.items()]


#: Our HTTP statuses as gRPC status names (a TorchServe client sees the same message text
#: over either transport); anything else is INTERNAL.
GRPC_CODES: dict[int, str] = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "PERMISSION_DENIED",  # model API disabled, as TorchServe answers
    408: "DEADLINE_EXCEEDED",
    409: "ALREADY_EXISTS",
    413: "RESOURCE_EXHAUSTED",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
    507: "RESOURCE_EXHAUSTED",
}


def grpc_code(http_status: int) -> grpc.StatusCode:
    """The gRPC status for an HTTP status (grpc is imported only by the gRPC transport)."""
    import grpc

    return grpc.StatusCode[GRPC_CODES.get(http_status, "INTERNAL")]
