"""Errors raised inside the worker, and the one place that maps any exception to an ErrorCode.

Exceptions never cross the process boundary: the worker sends ``Error{code, message}`` for a
failed load or batch, and ``Response{status, error, error_type}`` for a single failed request.
"""

from __future__ import annotations

import sys

from protos import worker_pb2

ErrorCode = worker_pb2.ErrorCode


class BackendError(Exception):
    """Base of the worker's own errors; each class carries its ErrorCode and HTTP status."""

    code: ErrorCode = worker_pb2.INTERNAL
    status: int = 500


class InvalidInput(BackendError):
    """The request's input cannot be processed (bad JSON, corrupt image, wrong shape).

    Raised by a handler on the whole batch it fails the batch with INVALID_INPUT; returned as
    the item of one request it fails only that request, with status 400.
    """

    code = worker_pb2.INVALID_INPUT
    status = 400


class Unsupported(BackendError):
    """The handler cannot do what the batch asks: explain, when it has no explanation path or
    Captum is not installed. Every request of the batch gets it, with status 501."""

    status = 501


class HandlerLoadError(BackendError):
    """The handler named by the LOAD message cannot be found, imported or instantiated."""

    code = worker_pb2.LOAD_FAILED


class ModelLoadError(BackendError):
    """The model the manifest names (modelFile, serializedFile) cannot be built or loaded."""

    code = worker_pb2.LOAD_FAILED


class BatchSizeMismatch(BackendError):
    """The handler returned a number of results different from the number of requests."""

    code = worker_pb2.BATCH_SIZE_MISMATCH


class InvalidHandlerOutput(BackendError):
    """The handler returned something other than a list (or tuple) of results."""


def is_prediction_exception(exc: BaseException) -> bool:
    """Whether ``exc`` is TorchServe's ``ts.utils.util.PredictionException`` (or looks like it).

    Matched by class name so that unmodified TorchServe handlers, which import it from their
    own ``ts`` package, keep their custom HTTP status (``error_code``).
    """
    return any(cls.__name__ == "PredictionException" for cls in type(exc).__mro__) and hasattr(
        exc, "error_code"
    )


def is_out_of_memory(exc: BaseException) -> bool:
    """Host or accelerator memory ran out, as typed exceptions say (never by message text)."""
    if isinstance(exc, MemoryError):
        return True
    # NOTE: only look at torch if a handler already imported it; importing it here would cost
    # seconds for handlers that never use it.
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    oom_types = tuple(
        t
        for t in (
            getattr(torch, "OutOfMemoryError", None),
            getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None),
        )
        if isinstance(t, type)
    )
    return bool(oom_types) and isinstance(exc, oom_types)


def describe(exc: BaseException) -> str:
    """``"<ExcType>: <message>"``, or just the type name when the message is empty."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def classify(exc: BaseException) -> tuple[ErrorCode, str]:
    """Map an exception that failed a whole batch to the ErrorCode and message to send."""
    if isinstance(exc, (InvalidInput, BatchSizeMismatch)):
        return exc.code, str(exc)
    if is_out_of_memory(exc):
        return worker_pb2.OUT_OF_MEMORY, describe(exc)
    if isinstance(exc, BackendError):
        return exc.code, describe(exc)
    return worker_pb2.INTERNAL, describe(exc)


def request_status(exc: BaseException) -> int:
    """The HTTP status for one request that failed with ``exc`` (500 unless it says otherwise)."""
    if is_prediction_exception(exc):
        status = getattr(exc, "error_code", 500)
    else:
        status = getattr(exc, "status", 500)
    if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
        return 500
    return status


def request_message(exc: BaseException) -> str:
    """The message for one failed request: PredictionException's ``message``, our own errors'
    text, and for anything else its class too (``KeyError: 'x'``): the client's error body
    names its type by status, not by the handler's exception class."""
    if is_prediction_exception(exc):
        message = getattr(exc, "message", None)
        if isinstance(message, str):
            return message
    if isinstance(exc, BackendError):
        return str(exc) or type(exc).__name__
    return describe(exc)
