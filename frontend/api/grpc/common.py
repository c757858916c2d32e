"""What every gRPC servicer shares: the RPC snapshot, the token check and the error mapping
(one decorator, ``unary``), a worker's answer as a body."""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, NoReturn, TypeAlias, TypeVar

import grpc
from google.rpc import status_pb2

from frontend.errors import ServeError, WorkerError, grpc_code, type_for_status
from frontend.ops.auth import KeyKind, TokenAuthority
from frontend.ops.plane import SERVER_TIMING, Call, InferencePlane, Origin
from frontend.ops.services import Services
from protos import worker_pb2

T = TypeVar("T")
#: A servicer's RPC context (generic in the stubs only).
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class Servicer:
    """A servicer with the server's token authority (None: tokens are off)."""

    def __init__(self, auth: TokenAuthority | None) -> None:
        self.auth = auth

    def check(self, kind: KeyKind, headers: list[tuple[bytes, bytes]]) -> None:
        """Raise the token error unless ``headers`` carry a valid key of ``kind``."""
        if self.auth is not None:
            self.auth.check(kind, headers)


class PredictionServicer(Servicer):
    """What both inference services share: the registry, the plane, the request limits."""

    def __init__(self, services: Services) -> None:
        super().__init__(services.auth)
        self.registry = services.registry
        self.plane = services.plane
        self.max_inputs = services.config.max_request_inputs
        self.max_rows = services.config.max_request_instances


S = TypeVar("S", bound=Servicer)
Method: TypeAlias = Callable[[S, Any, Context], Coroutine[Any, Any, Any]]


def unary(key: KeyKind | None = None) -> Callable[[Method[S]], Method[S]]:
    """A unary RPC: the client's token checked first (``key``: which key it needs; None: the
    method checks it itself, inside its plane call, so that a refusal is recorded), and our
    errors answered as gRPC statuses with the REST message text (``answer``)."""

    def decorate(method: Method[S]) -> Method[S]:
        @functools.wraps(method)
        async def run(self: S, request: Any, context: Context) -> Any:
            async def checked() -> Any:
                if key is not None:
                    self.check(key, metadata_headers(context))
                return await method(self, request, context)

            return await answer(context, checked())

        return run

    return decorate


async def answer(context: Context, call: Awaitable[T]) -> T:
    """Run an RPC body; map our errors to a gRPC status with the REST message text."""
    try:
        return await call
    except ServeError as error:
        await abort(context, error)


async def abort(context: Context, error: ServeError) -> NoReturn:
    """End the RPC with ``error``'s gRPC status and its REST message text."""
    await context.abort(grpc_code(error.http_status), error.message)
    raise AssertionError("unreachable: abort raises")


def metadata_headers(context: Context) -> list[tuple[bytes, bytes]]:
    return [(key.lower().encode("latin-1"), value.encode("latin-1"))
            for key, value in (context.invocation_metadata() or ())
            if isinstance(value, str)]


@dataclass(frozen=True, slots=True)
class Rpc:
    """What the requests of one RPC need of it, read once while the RPC is live.

    NOTE: nothing may touch a gRPC context after its RPC has ended: grpc's C core does not
    survive ``context.peer()`` on a finished call (a client that left a StreamPredictions2
    stream early took the whole frontend down with SIGSEGV). Per-request work, which may
    outlive the RPC, reads this snapshot instead.
    """

    peer: str
    headers: list[tuple[bytes, bytes]]
    #: time.monotonic() of the client's deadline (None: it set none).
    deadline: float | None

    @classmethod
    def of(cls, context: Context) -> Rpc:
        remaining = context.time_remaining()
        return cls(context.peer(), metadata_headers(context),
                   None if remaining is None else time.monotonic() + remaining)

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def origin(self, path: str) -> Origin:
        return Origin(self.peer, "gRPC", path, "HTTP/2.0", count_status=True)


def send_timing(context: Context, call: Call) -> None:
    """Put the call's Server-Timing in the RPC's trailing metadata when it wants it (the
    ``server_timing`` key, and the request's ``x-server-timing`` metadata). Called while the
    RPC is live, before its answer is returned."""
    value = InferencePlane.timing_header(call)
    if value is not None:
        context.set_trailing_metadata(((SERVER_TIMING, value),))


def body_of(response: worker_pb2.Response) -> bytes:
    """The body of a worker's answer, or its per-request error raised as a ServeError."""
    if response.error:
        status = response.status or 500
        raise WorkerError(status, type_for_status(status), response.error)
    return response.body

def rpc_status(http_status: int, message: str) -> status_pb2.Status:
    return status_pb2.Status(code=grpc_code(http_status).value[0], message=message)


