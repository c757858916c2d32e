"""The one route table of the HTTP ports (frontend/api/http/routes.py): every route it knows
is recognised by exactly one entry, in TorchServe's order where paths overlap, and the fast
path (frontend/api/http/fast.py) imports only what it serves."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from frontend.api.http import routes
from frontend.api.http.openapi import inference_description, management_description
from frontend.api.http.routes import ROUTES, TARGET, Api, Route, RouteTable

ROOT = Path(__file__).resolve().parent.parent.parent
_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
#: A value for each path parameter of the descriptions' and the table's paths.
_VALUES = {"model_name": "m", "model_version": "1.0", "workflow_name": "w"}
#: What the fast path does not serve: the ASGI apps and what only they use.
NOT_ON_THE_FAST_PATH = (
    "frontend.api.http.inference", "frontend.api.http.kserve", "frontend.api.http.openapi",
    "frontend.api.http.management", "frontend.api.http.metrics", "frontend.api.http.dashboard",
    "frontend.api.http.app", "frontend.ops.kserve", "frontend.ops.workflow_runs",
    "frontend.ops.workflow_management", "frontend.ops.management", "frontend.ops.dashboard",
    "frontend.ops.services", "frontend.workflows", "frontend.models.loader",
    "frontend.models.snapshot",
)


def _concrete(template: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda match: _VALUES[match[1]], template)


def _binding(table: RouteTable, method: str, path: str) -> list[Route]:
    """Every route of ``table`` that would take the request (not only the first)."""
    parts = [part for part in path.split("/") if part]
    return [route for route in table.routes if route.bind(method, path, parts) is not None]


@pytest.mark.parametrize(("describe", "api"), [
    (inference_description, "inference"), (management_description, "management"),
], ids=["inference", "management"])
def test_every_documented_path_resolves_to_exactly_one_entry(
        describe: Callable[[], dict[str, Any]], api: Api) -> None:
    table = RouteTable.of([api], kserve=True)
    for template, item in describe()["paths"].items():
        for method in (m.upper() for m in _METHODS if m in item):
            path = _concrete(template)
            target = table.resolve(method, path)
            assert target is not None, (method, template)
            assert target.route.api == api and template in target.route.paths, \
                (method, template, target.route.name)
            assert _binding(table, method, path) == [target.route], (method, template)


def _method_for(route: Route, template: str) -> str:
    if template == "/" and route.name == "api-description":
        return "OPTIONS"
    return min(route.methods or {"GET"})


@pytest.mark.parametrize("route", ROUTES, ids=lambda route: f"{route.api}-{route.name}")
def test_every_entry_takes_each_of_its_paths_and_names_what_they_name(route: Route) -> None:
    """The undocumented routes too (legacy, SageMaker's, /wfpredict, the live page)."""
    table = RouteTable.of([route.api], kserve=True)
    for template in route.paths:
        method = _method_for(route, template)
        target = table.resolve(method, _concrete(template))
        assert target is not None and target.route is route, (template, target)
        assert _binding(table, method, _concrete(template)) == [route], template
        if "{model_name}" in template and route.name not in ("kserve-v1", "kserve-v2",
                                                              "models"):
            assert target.name == "m"
            assert target.version == ("1.0" if "{model_version}" in template else None)
        if "{workflow_name}" in template and route is routes.WFPREDICT:
            assert target.name == "w"


def test_every_route_has_a_unique_name_within_its_api() -> None:
    names = [(route.api, route.name) for route in ROUTES]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(("method", "path", "route", "name", "version"), [
    ("POST", "/predictions/m", routes.PREDICTIONS, "m", None),
    ("PUT", "/predictions/m/2", routes.PREDICTIONS, "m", "2"),
    ("POST", "/predictions/a/b/c", routes.PREDICTIONS, None, None),  # its route, no model: 404
    ("POST", "/predictions/", routes.PREDICTIONS, None, None),
    ("POST", "/explanations/m", routes.EXPLANATIONS, "m", None),
    ("POST", "/m/predict", routes.LEGACY, "m", None),
    ("POST", "/m/1.0/predict", routes.LEGACY, "m", "1.0"),
    ("POST", "/invocations", routes.INVOCATIONS, None, None),
    ("POST", "/invocations/", routes.INVOCATIONS, None, None),
    ("POST", "/models/m/invoke", routes.INVOKE, "m", None),
    ("POST", "/wfpredict/w", routes.WFPREDICT, "w", None),
    ("GET", "/wfpredict/w/x", routes.WFPREDICT, None, None),  # its route, no workflow: 404
    ("GET", "/execution-parameters", routes.EXECUTION_PARAMETERS, None, None),
    ("GET", "/ping", routes.PING, None, None),
    # KServe's paths are its, never a legacy /{model}/predict; v1 before anything else.
    ("POST", "/v1/predict", routes.KSERVE_V1, None, None),
    ("POST", "/v2/models/m/predict", routes.KSERVE_V2, None, None),
    ("GET", "/v2", routes.KSERVE_V2, None, None),
    ("GET", "/", routes.KSERVE_LIVE, None, None),
    ("OPTIONS", "/", routes.INFERENCE_DESCRIPTION, None, None),
    ("GET", "/api-description", routes.INFERENCE_DESCRIPTION, None, None),
    # On a listener that serves both, the inference API's routes come first (as its app
    # was tried first): SageMaker's invoke, and a legacy route over a management path.
    ("GET", "/models/m/invoke", routes.INVOKE, "m", None),
    ("POST", "/workflows/predict", routes.LEGACY, "workflows", None),
    ("GET", "/models/m/1.0", routes.MODELS, None, None),
    ("GET", "/models/m/1.0/set-default", routes.MODELS, None, None),
    ("GET", "/workflows/w", routes.WORKFLOWS, "w", None),
    ("GET", "/dashboard/data", routes.DASHBOARD, None, None),
    ("GET", "/token", routes.TOKEN, None, None),
    ("GET", "/metrics", routes.METRICS, None, None),
])
def test_a_listener_of_every_api_resolves_as_torchserve_routes(
        method: str, path: str, route: Route, name: str | None, version: str | None) -> None:
    table = RouteTable.of(["inference", "management", "metrics"], kserve=True)
    target = table.resolve(method, path)
    assert target is not None and target.route is route, target and target.route.name
    assert _binding(table, method, path)[0] is route  # the index finds the first that binds
    assert (target.name, target.version) == (name, version)
    assert target.parts == [part for part in path.split("/") if part]


@pytest.mark.parametrize(("apis", "method", "path"), [
    (("inference", "management", "metrics"), method, path) for method, path in [
        ("POST", "/predictions"), ("POST", "//predictions/m"), ("GET", "/v1"),
        ("POST", "/m/predict/"), ("POST", "/ping/predict"), ("POST", "/invocations/m"),
        ("GET", "/models/a/b/c/d"), ("GET", "/workflows/a/b"), ("GET", "/dashboard/other"),
        ("GET", "/metrics/"), ("POST", "/api-description"), ("GET", "/nowhere")]
] + [
    # The inference API alone: SageMaker's invoke is its only /models/... path.
    (("inference",), "POST", path) for path in ("/models/invoke", "/models/m/invoke/x",
                                                "/models/m/1.0", "/models")
])
def test_paths_of_no_route(apis: tuple[Api, ...], method: str, path: str) -> None:
    table = RouteTable.of(apis, kserve=True)
    assert table.resolve(method, path) is None
    assert _binding(table, method, path) == []


def test_kserves_liveness_is_a_route_only_under_kserve() -> None:
    assert RouteTable.of(["inference"]).resolve("GET", "/") is None
    assert routes.KSERVE_LIVE not in RouteTable.of(["inference"]).routes
    target = RouteTable.of(["inference"], kserve=True).resolve("GET", "/")
    assert target is not None and target.route is routes.KSERVE_LIVE


def test_the_fast_routes_are_the_predictions_torchserve_answers_from_a_body() -> None:
    fast = {route.name for route in ROUTES if route.fast}
    assert fast == {"predictions", "legacy", "invocations", "invoke"}
    assert {route.name for route in ROUTES if route.query_inputs} == {"legacy", "invocations",
                                                                       "invoke"}
    assert [route.name for route in ROUTES if route.explain] == ["explanations"]


def test_a_target_the_fast_path_found_is_not_looked_for_again() -> None:
    table = RouteTable.of(["inference"])
    found = table.resolve("POST", "/v2/models/m/infer")
    assert found is not None
    # The scope's path says otherwise: the target the fast path left is what counts.
    scope = {"method": "POST", "path": "/ping", TARGET: found}
    assert table.target(scope) is found
    assert table.target({**scope, TARGET: None}) is None  # it found no route
    ping = table.target({"method": "GET", "path": "/ping"})
    assert ping is not None and ping.route is routes.PING


def _modules_after_importing(module: str) -> set[str]:
    """The modules a fresh interpreter has once it has imported ``module``."""
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                            capture_output=True, text=True, timeout=60)
    return set(json.loads(result.stdout))


def _not_served(modules: set[str]) -> list[str]:
    return sorted(module for module in modules for banned in NOT_ON_THE_FAST_PATH
                  if module == banned or module.startswith(banned + "."))


def test_the_fast_path_imports_only_what_it_serves() -> None:
    """Importing the connection's fast path, in a fresh interpreter, imports none of the ASGI
    apps, KServe, workflows, the management operations or the OpenAPI description. (It does
    import SageMaker's rule for which model ``/invocations`` means: it serves that route.)"""
    modules = _modules_after_importing("frontend.api.http.fast")
    assert {"frontend.api.http.fast", "frontend.api.http.routes",
            "frontend.api.http.predictions", "frontend.ops.plane"} <= modules
    assert _not_served(modules) == []


def test_the_import_check_sees_an_import() -> None:
    """The same check on the inference app, which serves everything: it finds them."""
    found = _not_served(_modules_after_importing("frontend.api.http.inference"))
    assert {"frontend.api.http.inference", "frontend.api.http.kserve",
            "frontend.ops.workflow_runs", "frontend.api.http.openapi"} <= set(found)
