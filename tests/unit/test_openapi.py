"""The OpenAPI documents served at /api-description: valid, and true to our routes."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from openapi_spec_validator import validate

from frontend.api.http.openapi import inference_description, management_description

_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")

DESCRIBERS = pytest.mark.parametrize(
    "describe", [inference_description, management_description],
    ids=["inference", "management"])


def _operations(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in document["paths"].items():
        for method in _METHODS:
            if method in item:
                yield path, method, item[method]


def _routes(document: dict[str, Any]) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, method, _ in _operations(document)}


@DESCRIBERS
def test_document_is_valid_openapi_3_0(describe: Callable[[], dict[str, Any]]) -> None:
    document = describe()
    assert document["openapi"] == "3.0.1"
    validate(document)


@DESCRIBERS
def test_document_survives_json(describe: Callable[[], dict[str, Any]]) -> None:
    document = describe()
    assert json.loads(json.dumps(document)) == document


@DESCRIBERS
def test_each_call_returns_an_independent_copy(describe: Callable[[], dict[str, Any]]) -> None:
    first = describe()
    first["components"]["schemas"]["Error"]["properties"].clear()
    assert describe()["components"]["schemas"]["Error"]["properties"]


@DESCRIBERS
def test_operation_ids_are_unique(describe: Callable[[], dict[str, Any]]) -> None:
    ids = [operation["operationId"] for _, _, operation in _operations(describe())]
    assert len(ids) == len(set(ids))


@DESCRIBERS
def test_every_error_response_uses_the_error_schema(
        describe: Callable[[], dict[str, Any]]) -> None:
    for path, method, operation in _operations(describe()):
        for code, response in operation["responses"].items():
            if int(code) < 400 or path == "/ping":
                continue
            schema = response["content"]["application/json"]["schema"]
            if path.startswith(("/v1", "/v2")):  # KServe's own error body
                # Readiness answers {"ready": false} with its 503 (v1: GET /v1/models/{name}).
                if not (code == "503" and operation["operationId"].endswith("Ready")):
                    assert schema == {"$ref": "#/components/schemas/KServeError"}, \
                        (method, path, code)
            else:
                assert schema == {"$ref": "#/components/schemas/Error"}, (method, path, code)


def test_info() -> None:
    assert inference_description()["info"]["title"] == "batchserve inference API"
    assert management_description()["info"]["title"] == "batchserve management API"
    for document in (inference_description(), management_description()):
        assert document["info"]["version"] == "0.1.0"


def test_inference_routes() -> None:
    assert _routes(inference_description()) == {
        ("OPTIONS", "/"),
        ("GET", "/api-description"),
        ("GET", "/ping"),
        ("POST", "/predictions/{model_name}"),
        ("PUT", "/predictions/{model_name}"),
        ("POST", "/predictions/{model_name}/{model_version}"),
        ("PUT", "/predictions/{model_name}/{model_version}"),
        ("POST", "/explanations/{model_name}"),
        ("PUT", "/explanations/{model_name}"),
        ("POST", "/explanations/{model_name}/{model_version}"),
        ("PUT", "/explanations/{model_name}/{model_version}"),
        *KSERVE_ROUTES,
    }


def test_management_routes() -> None:
    assert _routes(management_description()) == {
        ("OPTIONS", "/"),
        ("GET", "/api-description"),
        ("GET", "/models"),
        ("POST", "/models"),
        ("GET", "/models/{model_name}"),
        ("PUT", "/models/{model_name}"),
        ("DELETE", "/models/{model_name}"),
        ("GET", "/models/{model_name}/{model_version}"),
        ("PUT", "/models/{model_name}/{model_version}"),
        ("DELETE", "/models/{model_name}/{model_version}"),
        ("PUT", "/models/{model_name}/{model_version}/set-default"),
        ("GET", "/token"),
    }


KSERVE_ROUTES = {
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_name}"),
    ("POST", "/v1/models/{model_name}:predict"),
    ("POST", "/v1/models/{model_name}:explain"),
    ("GET", "/v2"),
    ("GET", "/v2/health/live"),
    ("GET", "/v2/health/ready"),
    ("GET", "/v2/models/{model_name}"),
    ("GET", "/v2/models/{model_name}/versions/{model_version}"),
    ("GET", "/v2/models/{model_name}/ready"),
    ("GET", "/v2/models/{model_name}/versions/{model_version}/ready"),
    ("POST", "/v2/models/{model_name}/infer"),
    ("POST", "/v2/models/{model_name}/versions/{model_version}/infer"),
    ("POST", "/v2/models/{model_name}/explain"),
    ("POST", "/v2/models/{model_name}/versions/{model_version}/explain"),
}
_V2_MODEL = ("/v2/models/{model_name}", "/v2/models/{model_name}/versions/{model_version}")

INFERENCE_RESPONSES = {
    ("OPTIONS", "/"): {"200"},
    ("GET", "/api-description"): {"200"},
    ("GET", "/ping"): {"200", "500"},
    **{(method, path): {"200", "400", "401", "404", "413", "500", "503", "504"}
       for method in ("POST", "PUT")
       for path in ("/predictions/{model_name}", "/predictions/{model_name}/{model_version}")},
    **{(method, path): {"200", "400", "401", "404", "413", "500", "501", "503", "504"}
       for method in ("POST", "PUT")
       for path in ("/explanations/{model_name}", "/explanations/{model_name}/{model_version}")},
    ("GET", "/v1/models"): {"200", "401"},
    ("GET", "/v1/models/{model_name}"): {"200", "401", "404"},
    ("POST", "/v1/models/{model_name}:predict"): {"200", "400", "401", "404", "500", "503",
                                                  "504"},
    ("POST", "/v1/models/{model_name}:explain"): {"200", "400", "401", "404", "500", "501",
                                                  "503", "504"},
    ("GET", "/v2"): {"200", "401"},
    ("GET", "/v2/health/live"): {"200"},
    ("GET", "/v2/health/ready"): {"200", "503"},
    **{("GET", path): {"200", "401", "404"} for path in _V2_MODEL},
    **{("GET", f"{path}/ready"): {"200", "401", "404", "503"} for path in _V2_MODEL},
    **{("POST", f"{path}/infer"): {"200", "400", "401", "404", "500", "503", "504"}
       for path in _V2_MODEL},
    **{("POST", f"{path}/explain"): {"200", "400", "401", "404", "500", "501", "503", "504"}
       for path in _V2_MODEL},
}

MANAGEMENT_RESPONSES = {
    ("OPTIONS", "/"): {"200"},
    ("GET", "/api-description"): {"200"},
    ("GET", "/models"): {"200"},
    ("POST", "/models"): {"200", "202", "400", "401", "403", "405", "409", "500"},
    ("PUT", "/models/{model_name}/{model_version}/set-default"): {"200", "404"},
    ("GET", "/token"): {"200", "400", "401"},
    **{(method, path): codes
       for path in ("/models/{model_name}", "/models/{model_name}/{model_version}")
       for method, codes in (("GET", {"200", "404"}),
                             ("PUT", {"200", "202", "400", "404", "500"}),
                             ("DELETE", {"200", "403", "404", "405"}))},
}


@pytest.mark.parametrize(("describe", "expected"), [
    (inference_description, INFERENCE_RESPONSES),
    (management_description, MANAGEMENT_RESPONSES),
], ids=["inference", "management"])
def test_operations_list_their_responses(describe: Callable[[], dict[str, Any]],
                                         expected: dict[tuple[str, str], set[str]]) -> None:
    for path, method, operation in _operations(describe()):
        missing = expected[(method.upper(), path)] - set(operation["responses"])
        assert not missing, (method, path, missing)


def test_queue_full_response_declares_retry_after() -> None:
    for path, _, operation in _operations(inference_description()):
        if path.startswith(("/predictions/", "/explanations/")):
            assert "Retry-After" in operation["responses"]["503"]["headers"]


def _security(document: dict[str, Any], method: str, path: str) -> list[dict[str, Any]]:
    operation = document["paths"][path][method]
    return operation.get("security", document.get("security", []))


def test_inference_security() -> None:
    document = inference_description()
    scheme = document["components"]["securitySchemes"]["bearerAuth"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    for path, method, _ in _operations(document):
        needs_token = path.startswith(("/predictions/", "/explanations/", "/v1/", "/v2")) \
            and not path.startswith("/v2/health/")
        expected: list[dict[str, Any]] = [{"bearerAuth": []}] if needs_token else []
        assert _security(document, method, path) == expected, (method, path)


def test_management_security() -> None:
    document = management_description()
    schemes = document["components"]["securitySchemes"]
    for name in ("bearerAuth", "apiKeyAuth"):
        assert (schemes[name]["type"], schemes[name]["scheme"]) == ("http", "bearer")
    for path, method, _ in _operations(document):
        if path in ("/", "/api-description"):
            expected: list[dict[str, Any]] = []
        elif path == "/token":
            expected = [{"apiKeyAuth": []}]
        else:
            expected = [{"bearerAuth": []}]
        assert _security(document, method, path) == expected, (method, path)


def test_management_schemas() -> None:
    schemas = management_description()["components"]["schemas"]
    assert {"Error", "Status", "ModelList", "ModelDescription", "Worker"} <= set(schemas)
    description = schemas["ModelDescription"]
    assert "customizedMetadata" in description["properties"]
    assert "customizedMetadata" not in description["required"]
    assert set(description["properties"]["batching"]["required"]) == {
        "policy", "queueDepth", "inFlightBatches", "batchesTotal", "requestsTotal",
        "recentBatchSizes", "meanBatchSize", "dispatchReasons", "batchFill"}


def test_list_and_scale_parameters() -> None:
    paths = management_description()["paths"]
    listing = {p["name"]: p for p in paths["/models"]["get"]["parameters"]}
    assert listing["limit"]["schema"] == {"type": "integer", "default": 100, "minimum": 1,
                                          "maximum": 100}
    register = {p["name"]: p for p in paths["/models"]["post"]["parameters"]}
    assert register["url"]["required"] is True
    assert register["synchronous"]["schema"]["default"] is True
    scale = {p["name"]: p for p in paths["/models/{model_name}"]["put"]["parameters"]}
    assert scale["synchronous"]["schema"]["default"] is False
    assert set(scale) == {"min_worker", "max_worker", "number_gpu", "synchronous", "timeout"}
