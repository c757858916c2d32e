"""Every error a client can see, each stating its HTTP status once.

The HTTP layer (frontend/http/common.py) is the one place that renders these into
TorchServe's error body ``{"code": N, "type": "...", "message": "..."}``.
"""

from __future__ import annotations

from typing import ClassVar


class ServeError(Exception):
    """Base of every client-visible error."""

    http_status: ClassVar[int] = 500
    #: The "type" field of the error body; TorchServe clients sometimes match on it.
    type_name: ClassVar[str] = "InternalServerException"
    headers: dict[str, str]

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers or {}

    @property
    def message(self) -> str:
        return str(self)

    def to_body(self) -> dict[str, object]:
        return {"code": self.http_status, "type": self.type_name, "message": self.message}


class BadRequest(ServeError):
    http_status = 400
    type_name = "BadRequestException"


class InvalidInput(BadRequest):
    """The worker rejected this request's payload."""

    type_name = "InvalidInputException"


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


class ModelNotFound(NotFound):
    type_name = "ModelNotFoundException"


class ModelVersionNotFound(NotFound):
    type_name = "ModelVersionNotFoundException"


class MethodNotAllowed(ServeError):
    http_status = 405
    type_name = "MethodNotAllowedException"


class RequestTimeout(ServeError):
    http_status = 408
    type_name = "RequestTimeoutException"


class Conflict(ServeError):
    http_status = 409
    type_name = "ConflictStatusException"


class PayloadTooLarge(ServeError):
    http_status = 413
    type_name = "PayloadTooLargeException"


class InternalError(ServeError):
    pass


class BatchSizeMismatch(InternalError):
    pass


class WorkerDied(InternalError):
    """The worker process exited or its socket broke while it held requests."""


class ServiceUnavailable(ServeError):
    http_status = 503
    type_name = "ServiceUnavailableException"


class OutOfResources(ServeError):
    http_status = 507
    type_name = "OutOfResourcesException"


class GatewayTimeout(ServeError):
    """The worker did not answer within the model's response_timeout."""

    http_status = 504
    type_name = "RequestTimeoutException"


class ConfigError(Exception):
    """A configuration value is invalid; raised at startup, names the key."""


class ArchiveError(BadRequest):
    """A model archive is missing, malformed, unsafe or not allowed."""

    type_name = "ModelArchiveException"
