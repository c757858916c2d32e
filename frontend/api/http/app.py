"""Bind the HTTP listeners and serve our ASGI apps on them with uvicorn (httptools).

A listener is a ``uvicorn.Server`` driven by its ``startup(sockets=...)`` and
``shutdown(sockets=...)``, not by ``serve()``: ``serve()`` installs its own SIGINT/SIGTERM
handlers with ``signal.signal`` (replacing the CLI's ``loop.add_signal_handler``, and raising
the signal again when it returns) and polls ``should_exit`` every 0.1 s (its tick refreshes
the Date and Server headers, which are off here). Doing without it means doing the one step
of its private ``_serve`` that ``startup`` needs: creating ``server.lifespan``.
tests/unit/test_uvicorn_contract.py checks that step and every other uvicorn name used here
(uvicorn's minor version is pinned in setup.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import uvicorn

from frontend.api.http import common
from frontend.api.http.calls import ORIGIN, peer, request_target
from frontend.api.http.cors import CorsApp, CorsPolicy
from frontend.api.http.fast import protocol_for
from frontend.api.http.inference import InferenceApp
from frontend.api.http.management import ManagementApp
from frontend.api.http.metrics import MetricsApp
from frontend.api.http.predictions import PredictionRoutes
from frontend.api.http.protocol import ServerProtocol, with_peer_first
from frontend.api.http.routes import RoutedApp, RouteTable
from frontend.api.http.tls import TlsAcceptor
from frontend.config import DEFAULT_DRAIN_TIMEOUT_S, Address
from frontend.observe.logs import AccessLog
from frontend.ops.services import Services

logger = logging.getLogger(__name__)

#: How long open connections may take to finish their responses at shutdown (drain_timeout).
GRACEFUL_SHUTDOWN_S = DEFAULT_DRAIN_TIMEOUT_S


#: The listeners the front processes share (frontend/front/), and the API each serves.
SHARED = frozenset({"inference", "kserve"})
API_OF = {"inference": "inference", "kserve": "inference", "management": "management",
          "metrics": "metrics"}

#: One of the three APIs (TorchServe's inference, management and metrics).
Api = InferenceApp | ManagementApp | MetricsApp


class CombinedApp(RoutedApp):
    """One listener serving several APIs (TorchServe does this when addresses coincide): one
    route table of their routes, in their order, each route served by its API's app."""

    def __init__(self, apps: list[Api]) -> None:
        self.apps = apps
        super().__init__(RouteTable([route for app in apps for route in app.table.routes]),
                         {route: handler for app in apps
                          for route, handler in app.handlers.items()})


class CountedResponses:
    """An ASGI app whose responses are counted by status (Requests2XX/4XX/5XX), each request
    with its access-log line, as TorchServe logs every request (a prediction's line is the
    plane's: ``calls.ORIGIN``); the fast path and refused request heads count theirs in the
    connection protocol."""

    def __init__(self, app: common.AsgiApp, count: Callable[[int], None],
                 access: AccessLog | None = None) -> None:
        self.app = app
        self.count = count
        self.access = access

    async def __call__(self, scope: common.Scope, receive: common.Receive,
                       send: common.Send) -> None:
        status = 0  # none sent: the client left first

        async def counted(message: common.Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                self.count(status)
            await send(message)

        started = time.perf_counter()
        try:
            await self.app(scope, receive, counted)
        finally:
            origin = scope.get(ORIGIN)
            if self.access is not None and scope["type"] == "http" and (
                    origin is None or not origin.recorded):
                self.access.request(peer(scope), scope["method"], request_target(scope),
                                    f"HTTP/{scope.get('http_version', '1.1')}", status,
                                    time.perf_counter() - started)


def uvicorn_config(app: common.AsgiApp, http: type[asyncio.Protocol],
                   keep_alive_s: float = 5.0,
                   graceful_shutdown_s: float = GRACEFUL_SHUTDOWN_S) -> uvicorn.Config:
    """A listener's uvicorn settings, loaded: ``http`` is its connection protocol,
    ``keep_alive_s`` how long a connection may wait idle for its next request,
    ``graceful_shutdown_s`` how long open requests may take to finish at shutdown."""
    config = uvicorn.Config(
        app,
        http=http,
        interface="asgi3",
        ws="none",  # no WebSocket on any port: an Upgrade is ignored (protocol.py)
        lifespan="off",
        access_log=False,
        log_config=None,
        proxy_headers=False,
        server_header=False,
        date_header=False,
        # uvicorn annotates these int but only ever uses them as delays: fractions work.
        timeout_graceful_shutdown=graceful_shutdown_s,  # type: ignore[arg-type]
        timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]
    )
    config.load()
    return config


def bind(address: Address, reuse_port: bool = False) -> socket.socket:
    """Bind a TCP socket now, so a busy port fails the start at once. It listens only once it
    is served: until then a connection is refused, so a TCP probe (Kubernetes', Knative's
    for KServe) fails until the startup models are loaded, instead of connecting to a server
    that does not answer yet. ``reuse_port``: SO_REUSEPORT, for the front processes that
    accept on the same port (frontend/front/): the kernel spreads connections among them."""
    family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((address.host, address.port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind {address}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock


class HttpListeners:
    """The inference, management and metrics listeners (and, under KServe, the inference API
    on KServe's REST port too): bound early, served once ready; those whose address is
    ``https://`` with ``tls`` (frontend/api/http/tls.py). With ``inner`` (front processes:
    ``number_of_netty_threads`` > 1), the inference listeners bind with SO_REUSEPORT, and
    the inference app is served on the Unix socket ``inner`` too, for the connections the
    fronts splice to this process (``protocol.PeerFirst``)."""

    def __init__(self, services: Services, tls: ssl.SSLContext | None = None,
                 inner: Path | None = None) -> None:
        config = services.config
        apps: dict[str, Api] = {
            "inference": InferenceApp(services),
            "management": ManagementApp(services),
        }
        wanted = {"inference": config.inference_address,
                  "management": config.management_address}
        if config.enable_metrics_api:
            apps["metrics"] = MetricsApp(services)
            wanted["metrics"] = config.metrics_address
        # KServe's REST port is plain HTTP (KServe terminates TLS at its ingress), unless it is
        # the inference address's own port.
        kserve = Address(config.inference_address.host, config.kserve_rest_port)
        if config.kserve_protocol and (kserve.endpoint != config.inference_address.endpoint
                                       or not kserve.port):
            # Where KServe sends REST (8080), on the inference address's host; on the
            # inference address itself, that listener serves it (port 0 is always new).
            apps["kserve"] = apps["inference"]
            wanted["kserve"] = kserve
        # Listeners that share an address (port 0 excepted) become one combined listener.
        # (config.check_tls: those have one scheme.)
        groups: dict[tuple[str, int] | str, list[str]] = {}
        for name, address in wanted.items():
            key: tuple[str, int] | str = name if address.port == 0 else address.endpoint
            groups.setdefault(key, []).append(name)
        self._plan = [(names, wanted[names[0]], [apps[n] for n in names])
                      for names in groups.values()]
        if tls is None and any(address.is_tls for _, address, _ in self._plan):
            raise ValueError("an https:// address needs a TLS context")
        self._tls = tls
        self._sockets: list[tuple[list[str], socket.socket, Api | CombinedApp, bool]] = []
        self._servers: list[uvicorn.Server] = []
        self._acceptors: list[TlsAcceptor] = []
        self._inner = inner
        self._inner_served: tuple[uvicorn.Server, socket.socket] | None = None
        #: The inference listener's prediction routes and route table, once started: what
        #: the fronts' linked requests are served with (``linked.LinkedPredictions``).
        self.linked: tuple[PredictionRoutes, RouteTable] | None = None
        self.bound: dict[str, Address] = {}
        self._header_timeout_s = config.request_header_timeout_s
        self._keep_alive_s = config.keep_alive_timeout_s
        self._drain_timeout_s = config.drain_timeout_s
        self._metrics = services.metrics
        self._access = services.plane.access
        #: CORS on every listener; None (no cors_allowed_* key set): none, at no cost.
        self._cors = CorsPolicy.from_config(config)
        self.cors = self._cors

    def bind(self) -> None:
        try:
            for names, address, apps in self._plan:
                sock = bind(address, reuse_port=self._inner is not None and bool(
                    SHARED.intersection(names)))
                app = apps[0] if len(apps) == 1 else CombinedApp(apps)
                self._sockets.append((names, sock, app, address.is_tls))
                host, port = sock.getsockname()[:2]
                for name in names:
                    self.bound[name] = Address(host, port, address.is_tls)
        except OSError:
            self.close_sockets()
            raise

    def shared(self) -> list[tuple[list[str], Address]]:
        """The listeners the front processes share (SO_REUSEPORT): (the APIs each serves,
        its bound address)."""
        return [(sorted({API_OF[name] for name in names}), self.bound[names[0]])
                for names, _, _, _ in self._sockets if SHARED.intersection(names)]

    def close_sockets(self) -> None:
        for _, sock, _, _ in self._sockets:
            sock.close()
        self._sockets.clear()

    async def start(self) -> None:
        for names, sock, app, is_tls in self._sockets:
            apps = app.apps if isinstance(app, CombinedApp) else [app]
            inference = next((a for a in apps if isinstance(a, InferenceApp)), None)
            served: common.AsgiApp = common.HeadAsGet(app)
            if self._cors is not None:
                served = CorsApp(served, self._cors)
            protocol = protocol_for(inference.predictions if inference else None,
                                    self._header_timeout_s, self._metrics.count_response,
                                    self._cors, app.table)
            counted = CountedResponses(served, self._metrics.count_response, self._access)
            config = uvicorn_config(counted, protocol, self._keep_alive_s,
                                    self._drain_timeout_s)
            if "inference" in names and inference is not None:
                self.linked = (inference.predictions, app.table)
                if self._inner is not None:
                    await self._serve_inner(counted, protocol)
            server = uvicorn.Server(config)
            server.lifespan = config.lifespan_class(config)  # as Server._serve does
            if not is_tls:
                await server.startup(sockets=[sock])
                self._servers.append(server)
                continue
            assert self._tls is not None
            # No listener of uvicorn's own: the acceptor makes each connection's protocol
            # as Server.startup's create_protocol does, after its TLS handshake.
            await server.startup(sockets=[])
            self._servers.append(server)
            acceptor = TlsAcceptor(
                sock, self._tls, functools.partial(
                    protocol, config=config, server_state=server.server_state,
                    app_state=server.lifespan.state),
                first_byte_timeout_s=self._header_timeout_s,
                count_status=self._metrics.count_response, backlog=config.backlog)
            acceptor.start()
            self._acceptors.append(acceptor)

    async def _serve_inner(self, app: common.AsgiApp, protocol: type[ServerProtocol]) -> None:
        """The inference app on the Unix socket the fronts splice connections to (0600)."""
        assert self._inner is not None
        self._inner.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(self._inner))
        self._inner.chmod(0o600)
        sock.setblocking(False)
        config = uvicorn_config(app, with_peer_first(protocol), self._keep_alive_s,
                                self._drain_timeout_s)
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)  # as Server._serve does
        await server.startup(sockets=[sock])
        self._inner_served = server, sock

    async def stop(self) -> None:
        """Stop accepting, let open requests finish (within drain_timeout, every listener at
        once), close the sockets."""
        async def shutdown(server: uvicorn.Server, sock: socket.socket) -> None:
            with contextlib.suppress(Exception):
                await server.shutdown(sockets=[sock])

        acceptors, self._acceptors = self._acceptors, []
        await asyncio.gather(*(acceptor.close() for acceptor in acceptors))
        served = list(zip(self._servers, (sock for _, sock, _, _ in self._sockets),
                          strict=False))
        if self._inner_served is not None:
            served.append(self._inner_served)
            self._inner_served = None
        await asyncio.gather(*(shutdown(server, sock) for server, sock in served))
        self._servers.clear()
        self.close_sockets()
        if self._inner is not None:
            self._inner.unlink(missing_ok=True)


@contextlib.asynccontextmanager
async def serve_http(services: Services, tls: ssl.SSLContext | None = None,
                     inner: Path | None = None) -> AsyncIterator[HttpListeners]:
    listeners = HttpListeners(services, tls, inner)
    listeners.bind()
    try:
        yield listeners
    finally:
        await listeners.stop()
