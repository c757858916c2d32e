"""SageMaker's rules (frontend/ops/sagemaker.py) and which URLs take the connection's fast
path (frontend/api/http/fast.py: the fast routes of the route table,
frontend/api/http/routes.py); tests/integration/test_sagemaker_routes.py serves them."""

from __future__ import annotations

import pytest

from frontend.api.http.routes import RouteTable
from frontend.config import ServerConfig
from frontend.errors import BadRequest
from frontend.models.registry import ModelRegistry
from frontend.ops.sagemaker import execution_parameters, implied_model, model_from_fields


@pytest.mark.parametrize(("url", "fast"), [
    (b"/invocations", True),
    (b"/invocations?model_name=m&x=1", True),
    (b"/invocations/", True),
    (b"/models/m/invoke", True),
    (b"/models/m/invoke?model_name=x", True),
    (b"/m/predict", True),
    (b"/m/1.0/predict?q=1", True),
    (b"/invocations/m", False),
    (b"/models/m/1.0", False),
    (b"/models/invoke", False),
    (b"/models/m/invoke/x", False),
    (b"/v1/models/m/invoke", False),
    (b"/x/invocations", False),
    (b"/execution-parameters", False),
    (b"/models/predict", False),
])
def test_the_fast_path_takes_every_prediction_route(url: bytes, fast: bool) -> None:
    target = RouteTable.of(["inference"]).resolve("POST", url.partition(b"?")[0].decode())
    assert (target is not None and target.route.fast) is fast


def test_invocations_imply_the_single_startup_model() -> None:
    registry = ModelRegistry()
    assert implied_model(registry, None) is None
    assert implied_model(registry, "") == ""  # looked up as it is: 404
    assert implied_model(registry, "m") == "m"
    registry.startup_models.add("only")
    assert implied_model(registry, None) == implied_model(registry, "") == "only"
    assert implied_model(registry, "m") == "m"
    registry.startup_models.add("second")
    assert implied_model(registry, None) is None


def test_a_form_names_its_model_in_its_first_model_name_field() -> None:
    fields = [("data", b"d", None), ("model_name", "mödel".encode(), "text/plain"),
              ("model_name", b"later", None)]
    assert model_from_fields(fields) == "mödel"
    with pytest.raises(BadRequest, match=r"^Parameter model_name is required\.$"):
        model_from_fields([("data", b"d", None)])


@pytest.mark.parametrize(("max_request_size", "payload_mb"), [
    (6553500, 6),  # TorchServe's default: 6 whole MiB, as its plugin says
    (1000, 1),  # SageMaker's smallest
    (500 * 1024 * 1024, 100),  # SageMaker's largest
])
def test_execution_parameters_without_models(max_request_size: int, payload_mb: int) -> None:
    config = ServerConfig(max_request_size_bytes=max_request_size)
    assert execution_parameters(config, ModelRegistry()) == {
        "MaxConcurrentTransforms": 1, "BatchStrategy": "MULTI_RECORD",
        "MaxPayloadInMB": payload_mb}
