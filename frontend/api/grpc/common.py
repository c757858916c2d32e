"""What every gRPC servicer shares: the RPC snapshot, the token check, the error mapping and
the access-log line (one decorator, ``unary``), a worker's answer as a body."""

from __future__ import annotations

import asyncio
import functools
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn, TypeAlias, TypeVar

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

#: The metadata a front process (frontend/front/) names the client of a call it relays with:
#: ``<front number> <gRPC peer>``. Read only by the servers on the owner's inner Unix sockets
#: (``FrontCalls``); dropped from every call's headers, so a client that sends it gains nothing.
FRONT_PEER = "x-batchserve-front-peer"


class FrontCalls:
    """The calls the front processes relayed to this process's inner gRPC servers: whose
    client each is (``FRONT_PEER``), and how many each front brought
    (``batchserve_front_grpc_requests_total``)."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def client(self, context: Context) -> str:
        """The relayed call's client, as the access log writes it; counted for its front."""
        for key, value in context.invocation_metadata() or ():
            if key == FRONT_PEER and isinstance(value, str):
                number, _, peer = value.partition(" ")
                if number.isdigit():
                    self.counts[int(number)] = self.counts.get(int(number), 0) + 1
                return torchserve_peer(peer)
        return torchserve_peer(context.peer())


class Servicer:
    """A servicer with the server's token authority (None: tokens are off) and access log;
    with ``fronts``, it serves an inner Unix socket, whose calls name their client
    (``FrontCalls``)."""

    #: Its service's full name (``org.pytorch.serve.grpc.inference.InferenceAPIsService``).
    service: ClassVar[str]

    def __init__(self, services: Services, fronts: FrontCalls | None = None) -> None:
        self.auth: TokenAuthority | None = services.auth
        self.access = services.plane.access
        self.fronts = fronts

    def client(self, context: Context) -> str:
        """The RPC's client as TorchServe's access log writes it (``torchserve_peer``)."""
        if self.fronts is not None:
            return self.fronts.client(context)
        return torchserve_peer(context.peer())

    def rpc(self, context: Context, name: str) -> Rpc:
        """The snapshot of this service's RPC ``name`` (``Predictions``), while it is live."""
        return Rpc.of(context, f"{self.service}/{name}", self.client(context))

    def check(self, kind: KeyKind, headers: list[tuple[bytes, bytes]]) -> None:
        """Raise the token error unless ``headers`` carry a valid key of ``kind``."""
        if self.auth is not None:
            self.auth.check(kind, headers)


class PredictionServicer(Servicer):
    """What both inference services share: the registry, the plane, the request limits."""

    def __init__(self, services: Services, fronts: FrontCalls | None = None) -> None:
        super().__init__(services, fronts)
        self.registry = services.registry
        self.plane = services.plane
        self.max_inputs = services.config.max_request_inputs
        self.max_rows = services.config.max_request_instances


S = TypeVar("S", bound=Servicer)
Method: TypeAlias = Callable[[S, Any, Context], Coroutine[Any, Any, Any]]


def unary(key: KeyKind | None = None, *, prediction: bool = False
          ) -> Callable[[Method[S]], Method[S]]:
    """A unary RPC: the client's token checked first (``key``: which key it needs; None: none,
    or the method checks it itself), our errors answered as gRPC statuses with the REST
    message text (``answer``), and its access-log line written once it ends, as TorchServe
    logs every RPC. A ``prediction`` writes its own, through its plane call (which records a
    refusal too: it checks the token inside)."""

    def decorate(method: Method[S]) -> Method[S]:
        name = method.__name__

        @functools.wraps(method)
        async def run(self: S, request: Any, context: Context) -> Any:
            async def checked() -> Any:
                if key is not None:
                    self.check(key, metadata_headers(context))
                return await method(self, request, context)

            if prediction:
                return await answer(context, checked())
            started, status, client = time.perf_counter(), 500, self.client(context)
            try:
                result = await checked()
                status = 200
                return result
            except ServeError as error:
                status = error.http_status
                await abort(context, error)
            except asyncio.CancelledError:
                status = 0  # the client left
                raise
            finally:
                self.access.request(client, "gRPC", f"{self.service}/{name}", "HTTP/2.0",
                                    status, time.perf_counter() - started)

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
    """The call's text metadata as headers, without ``FRONT_PEER`` (the server's own)."""
    return [(key.lower().encode("latin-1"), value.encode("latin-1"))
            for key, value in (context.invocation_metadata() or ())
            if isinstance(value, str) and key != FRONT_PEER]


@dataclass(frozen=True, slots=True)
class Rpc:
    """What the requests of one RPC need of it, read once while the RPC is live.

    NOTE: nothing may touch a gRPC context after its RPC has ended: grpc's C core does not
    survive ``context.peer()`` on a finished call (a client that left a StreamPredictions2
    stream early took the whole frontend down with SIGSEGV). Per-request work, which may
    outlive the RPC, reads this snapshot instead.
    """

    #: The client's address as TorchServe's access log writes it (``torchserve_peer``).
    peer: str
    headers: list[tuple[bytes, bytes]]
    #: time.monotonic() of the client's deadline (None: it set none).
    deadline: float | None
    #: The RPC's ``<service>/<method>``, as TorchServe's access log names it.
    method: str

    @classmethod
    def of(cls, context: Context, method: str, peer: str | None = None) -> Rpc:
        """``peer``: the client as the servicer knows it (None: the connection's)."""
        remaining = context.time_remaining()
        return cls(torchserve_peer(context.peer()) if peer is None else peer,
                   metadata_headers(context),
                   None if remaining is None else time.monotonic() + remaining, method)

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def origin(self, path: str) -> Origin:
        """A prediction's origin: ``path`` names it in a trace, the method in the access log."""
        return Origin(self.peer, "gRPC", path, "HTTP/2.0", count_status=True, uri=self.method)


def torchserve_peer(peer: str) -> str:
    """gRPC's ``ipv4:127.0.0.1:41696`` as TorchServe's access log writes a client:
    ``/127.0.0.1:41696`` (``/[::1]:41696`` for IPv6); another kind of address as it is."""
    kind, _, address = peer.partition(":")
    return f"/{urllib.parse.unquote(address)}" if kind in ("ipv4", "ipv6") else peer


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


