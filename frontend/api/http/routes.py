"""The one route table of the HTTP ports: every path they serve, recognised once.

A request's path is resolved once, where it is first read: by the connection's fast path
(frontend/api/http/fast.py) for a POST or PUT on a listener that serves inference, else by
the listener's ASGI app (``RoutedApp``); the fast path leaves what it found in the scope
(``TARGET``) for the app it hands a request to. Each entry is one link, as a handler is in
TorchServe's chain: its name, its API, the paths it takes (as the OpenAPI descriptions write
them), what its path names (a model and version, a workflow), and whether the fast path serves
it; the apps map entries to their handlers (``Handler``).

Entries are tried in the listener's API order (inference, management, metrics) and, within an
API, in the order below, which is TorchServe's where paths overlap: a legacy
``/{model}/predict`` loses to every other route of the inference API, and wins over the
management API's paths on a listener that serves both (as the inference app always did, tried
first). A route that takes a path but finds no model in it (``/predictions/a/b/c``) is still
that route's: its handler answers 404.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from frontend.api.http import common
from frontend.errors import RouteNotFound, ServeError

Api = Literal["inference", "management", "metrics"]
#: What a route's path names: (model or workflow, version); (None, None): nothing.
Bound = tuple[str | None, str | None]
#: How a route decides: (method, path, the path's non-empty segments) -> what it names, or
#: None when the path is not the route's.
Binder = Callable[[str, str, list[str]], Bound | None]

#: The scope key under which the fast path leaves the target it resolved (None: no route).
TARGET = "batchserve.target"
_NOTHING: Bound = (None, None)
_PREDICTION_METHODS = frozenset({"POST", "PUT"})
#: First path segments the inference API routes elsewhere: never a model's legacy route.
_NOT_LEGACY = frozenset({"predictions", "explanations", "ping", "models", "invocations",
                         "wfpredict"})


@dataclass(frozen=True, slots=True, eq=False)
class Route:
    """One entry of the table (compared by identity: the apps key their handlers by it)."""

    name: str
    api: Api
    #: The paths it serves, as the OpenAPI descriptions write them (its documentation).
    paths: tuple[str, ...]
    bind: Binder
    #: The first path segments it can take ("" for ``/``; empty: any): the table's index, so
    #: that a request is offered to the few routes that may take it (``bind`` checks again).
    firsts: tuple[str, ...] = ()
    #: The methods it serves (None: its handler decides: any, or it answers 405 itself).
    methods: frozenset[str] | None = None
    #: A prediction the connection's fast path answers (when nothing else sends it the ASGI
    #: way: a pipelined request, an upgrade).
    fast: bool = False
    #: A prediction with TorchServe's ``explain`` header.
    explain: bool = False
    #: Its query parameters are inputs too, as TorchServe passes them (the legacy routes and
    #: SageMaker's).
    query_inputs: bool = False


class Target:
    """A request's route and what its path names (one per request: a plain class)."""

    __slots__ = ("name", "parts", "query", "route", "version")

    def __init__(self, route: Route, parts: list[str], name: str | None,
                 version: str | None) -> None:
        self.route = route
        #: The path's non-empty segments.
        self.parts = parts
        #: The model (or workflow) the path names; None: none (the route's handler says 404,
        #: or, for ``/invocations``, finds it elsewhere).
        self.name = name
        self.version = version
        #: Its query as inputs, once read (``predictions.query_inputs``): read once.
        self.query: list[tuple[str, bytes, str | None]] | None = None


#: What serves a route: (target, scope, receive, send).
Handler = Callable[[Target, common.Scope, common.Receive, common.Send], Awaitable[None]]


class RouteTable:
    """The routes of one listener's APIs, indexed by their first path segment."""

    __slots__ = ("_any", "_index", "routes")

    def __init__(self, routes: Sequence[Route]) -> None:
        self.routes = tuple(routes)
        self._any = [route for route in self.routes if not route.firsts]
        firsts = {first for route in self.routes for first in route.firsts}
        self._index = {first: [route for route in self.routes
                               if not route.firsts or first in route.firsts]
                       for first in firsts}

    @classmethod
    def of(cls, apis: Iterable[Api], kserve: bool = False,
           first: Sequence[Route] = ()) -> RouteTable:
        """The table of a listener serving ``apis``, in that order; ``kserve``: KServe's
        liveness on ``GET /`` too (``PROTOCOL_VERSION`` set); ``first``: routes of the
        server's own (Vertex AI's, ``vertex_routes``) tried before the rest of their API's."""
        return cls([route for api in apis
                    for route in (*(r for r in first if r.api == api), *ROUTES)
                    if route.api == api and (kserve or route is not KSERVE_LIVE)])

    def resolve(self, method: str, path: str) -> Target | None:
        """The route of a request (``path`` decoded); None when no route takes it."""
        parts = [part for part in path.split("/") if part]
        for route in self._index.get(parts[0] if parts else "", self._any):
            bound = route.bind(method, path, parts)
            if bound is not None:
                return Target(route, parts, bound[0], bound[1])
        return None

    def target(self, scope: common.Scope) -> Target | None:
        """The request's route: the one the fast path found, else found now."""
        if TARGET in scope:
            found: Target | None = scope[TARGET]
            return found
        return self.resolve(scope["method"], scope["path"])


# -- how each route reads its path ----------------------------------------------------------


def _name_version(parts: list[str]) -> Bound:
    """``/<route>/{name}`` or ``/<route>/{name}/{version}``; nothing for another length."""
    if len(parts) == 2:
        return parts[1], None
    if len(parts) == 3:
        return parts[1], parts[2]
    return _NOTHING


def _predictions(method: str, path: str, parts: list[str]) -> Bound | None:
    return _name_version(parts) if path.startswith("/predictions/") else None


def _explanations(method: str, path: str, parts: list[str]) -> Bound | None:
    return _name_version(parts) if path.startswith("/explanations/") else None


def _ping(method: str, path: str, parts: list[str]) -> Bound | None:
    return _NOTHING if path == "/ping" else None


def _wfpredict(method: str, path: str, parts: list[str]) -> Bound | None:
    """``/wfpredict/{workflow}`` (another length: the route's, naming none)."""
    if not parts or parts[0] != "wfpredict":
        return None
    return (parts[1] if len(parts) == 2 else None, None)


def _invocations(method: str, path: str, parts: list[str]) -> Bound | None:
    """SageMaker's ``/invocations`` (its model: ``predictions.PredictionRoutes.open``)."""
    return _NOTHING if parts == ["invocations"] else None


def _invoke(method: str, path: str, parts: list[str]) -> Bound | None:
    """SageMaker's multi-model ``/models/{name}/invoke``. Any other ``/models/...`` path is
    not the inference API's: on a listener that serves management too, it is management's."""
    if len(parts) == 3 and parts[0] == "models" and parts[2] == "invoke":
        return parts[1], None
    return None


def _execution_parameters(method: str, path: str, parts: list[str]) -> Bound | None:
    return _NOTHING if parts == ["execution-parameters"] else None


def _kserve_live(method: str, path: str, parts: list[str]) -> Bound | None:
    return _NOTHING if path == "/" and method == "GET" else None


def _kserve_v1(method: str, path: str, parts: list[str]) -> Bound | None:
    return _NOTHING if path.startswith("/v1/") else None


def _kserve_v2(method: str, path: str, parts: list[str]) -> Bound | None:
    return _NOTHING if path == "/v2" or path.startswith("/v2/") else None


def _legacy(method: str, path: str, parts: list[str]) -> Bound | None:
    """TorchServe's legacy ``/{model}/predict`` and ``/{model}/{version}/predict``; not the
    paths TorchServe routes elsewhere (``/models/...``, KServe's ``/v1/models/...`` and
    ``/v2/models/...``)."""
    if (len(parts) not in (2, 3) or parts[-1] != "predict" or parts[0] in _NOT_LEGACY
            or not path.endswith("/predict")):
        return None
    if len(parts) == 3:
        if parts[0] in ("v1", "v2") and parts[1] == "models":
            return None
        return parts[0], parts[1]
    return parts[0], None


def _api_description(method: str, path: str, parts: list[str]) -> Bound | None:
    """``GET /api-description`` or ``OPTIONS /``: TorchServe's OpenAPI self-description."""
    if (path == "/api-description" and method == "GET") or (path == "/" and method == "OPTIONS"):
        return _NOTHING
    return None


def _token(method: str, path: str, parts: list[str]) -> Bound | None:
    return _NOTHING if parts == ["token"] else None


def _dashboard(method: str, path: str, parts: list[str]) -> Bound | None:
    """``/dashboard`` (the live page) and ``/dashboard/data`` (what it polls)."""
    if parts and parts[0] == "dashboard" and (len(parts) == 1 or parts[1:] == ["data"]):
        return _NOTHING
    return None


def _workflows(method: str, path: str, parts: list[str]) -> Bound | None:
    """``/workflows`` and ``/workflows/{name}``."""
    if not parts or parts[0] != "workflows" or len(parts) > 2:
        return None
    return (parts[1] if len(parts) == 2 else None, None)


def _models(method: str, path: str, parts: list[str]) -> Bound | None:
    """``/models`` up to ``/models/{name}/{version}/set-default`` (the management app reads
    the rest, after the token check, as TorchServe does)."""
    return _NOTHING if parts and parts[0] == "models" and len(parts) <= 4 else None


def _metrics(method: str, path: str, parts: list[str]) -> Bound | None:
    return _NOTHING if path == "/metrics" else None


def vertex_routes(health: str, predict: str, model: str) -> tuple[Route, ...]:
    """Vertex AI's routes (``AIP_HEALTH_ROUTE``, ``AIP_PREDICT_ROUTE``: the config's
    ``vertex_health_route`` and ``vertex_predict_route``), each its one path exactly: health
    checks, answered as ``/ping``, and predictions of ``model``, as ``/predictions/{model}``
    (POST; the fast path serves them). None where unset."""
    found: list[Route] = []
    if health:
        found.append(Route("vertex-health", "inference", (health,), _exactly(health, None),
                           (_first(health),)))
    if predict:
        found.append(Route("vertex-predict", "inference", (predict,), _exactly(predict, model),
                           (_first(predict),), _PREDICTION_METHODS, fast=True))
    return tuple(found)


def _exactly(route_path: str, name: str | None) -> Binder:
    bound: Bound = (name, None)

    def bind(method: str, path: str, parts: list[str]) -> Bound | None:
        return bound if path == route_path else None
    return bind


def _first(path: str) -> str:
    """The first non-empty segment of a path ("" for ``/``), as ``resolve`` indexes it."""
    return next((part for part in path.split("/") if part), "")


# -- the table ------------------------------------------------------------------------------

_DESCRIPTION_PATHS = ("/", "/api-description")

PREDICTIONS = Route(
    "predictions", "inference",
    ("/predictions/{model_name}", "/predictions/{model_name}/{model_version}"),
    _predictions, ("predictions",), _PREDICTION_METHODS, fast=True)
EXPLANATIONS = Route(
    "explanations", "inference",
    ("/explanations/{model_name}", "/explanations/{model_name}/{model_version}"),
    _explanations, ("explanations",), _PREDICTION_METHODS, explain=True)
PING = Route("ping", "inference", ("/ping",), _ping, ("ping",))
WFPREDICT = Route("wfpredict", "inference", ("/wfpredict/{workflow_name}",), _wfpredict,
                  ("wfpredict",))
INVOCATIONS = Route("invocations", "inference", ("/invocations",), _invocations,
                    ("invocations",), _PREDICTION_METHODS, fast=True, query_inputs=True)
INVOKE = Route("invoke", "inference", ("/models/{model_name}/invoke",), _invoke, ("models",),
               _PREDICTION_METHODS, fast=True, query_inputs=True)
EXECUTION_PARAMETERS = Route("execution-parameters", "inference", ("/execution-parameters",),
                             _execution_parameters, ("execution-parameters",),
                             frozenset({"GET"}))
KSERVE_LIVE = Route("kserve-live", "inference", ("/",), _kserve_live, ("",))
KSERVE_V1 = Route(
    "kserve-v1", "inference",
    ("/v1/models", "/v1/models/{model_name}", "/v1/models/{model_name}:predict",
     "/v1/models/{model_name}:explain"),
    _kserve_v1, ("v1",))
KSERVE_V2 = Route(
    "kserve-v2", "inference",
    ("/v2", "/v2/health/live", "/v2/health/ready",
     *(f"{model}{rest}"
       for model in ("/v2/models/{model_name}", "/v2/models/{model_name}/versions/{model_version}")
       for rest in ("", "/ready", "/infer", "/explain"))),
    _kserve_v2, ("v2",))
LEGACY = Route("legacy", "inference",
               ("/{model_name}/predict", "/{model_name}/{model_version}/predict"), _legacy,
               (), _PREDICTION_METHODS, fast=True, query_inputs=True)
INFERENCE_DESCRIPTION = Route("api-description", "inference", _DESCRIPTION_PATHS,
                              _api_description, ("", "api-description"))

MANAGEMENT_DESCRIPTION = Route("api-description", "management", _DESCRIPTION_PATHS,
                               _api_description, ("", "api-description"))
TOKEN = Route("token", "management", ("/token",), _token, ("token",), frozenset({"GET"}))
DASHBOARD = Route("dashboard", "management", ("/dashboard", "/dashboard/data"), _dashboard,
                  ("dashboard",))
WORKFLOWS = Route("workflows", "management", ("/workflows", "/workflows/{workflow_name}"),
                  _workflows, ("workflows",))
MODELS = Route(
    "models", "management",
    ("/models", "/models/{model_name}", "/models/{model_name}/{model_version}",
     "/models/{model_name}/{model_version}/set-default"),
    _models, ("models",))

METRICS = Route("metrics", "metrics", ("/metrics",), _metrics, ("metrics",),
                frozenset({"GET"}))

#: Every route, each API's in the order they are tried.
ROUTES: tuple[Route, ...] = (
    PREDICTIONS, EXPLANATIONS, PING, WFPREDICT, INVOCATIONS, INVOKE, EXECUTION_PARAMETERS,
    KSERVE_LIVE, KSERVE_V1, KSERVE_V2, LEGACY, INFERENCE_DESCRIPTION,
    MANAGEMENT_DESCRIPTION, TOKEN, DASHBOARD, WORKFLOWS, MODELS,
    METRICS,
)


class RoutedApp:
    """Base of our ASGI apps: a request's route found in the table (once: the fast path may
    have found it), served by the app's handler for it; a ServeError is answered here, in
    TorchServe's error body (KServe's routes answer theirs in KServe's)."""

    def __init__(self, table: RouteTable, handlers: Mapping[Route, Handler]) -> None:
        missing = [route.name for route in table.routes if route not in handlers]
        assert not missing, f"no handler for {missing}"
        self.table = table
        self.handlers = dict(handlers)

    async def __call__(self, scope: common.Scope, receive: common.Receive,
                       send: common.Send) -> None:
        if scope["type"] != "http":
            return
        try:
            target = self.table.target(scope)
            if target is None:
                raise RouteNotFound()
            await self.handlers[target.route](target, scope, receive, send)
        except common.ClientDisconnected:
            return
        except ServeError as error:
            await common.send_error(send, error)
