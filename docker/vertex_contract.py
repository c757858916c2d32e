"""Vertex AI's prebuilt PyTorch image contract as checks on a running server, shared by the
image's smoke test (docker/vertex_smoke.py) and the test of the real server in ``make test``
(tests/integration/test_vertex.py), so that both hold the same contract.

The model is one built for Google's prebuilt image: ``model.mar`` (``--model-name model``)
right under the artifact folder, its handler TorchServe-style
(tests/fixtures/vertex/sentiment_handler.py, written as Google's sample for the prebuilt
image is). The environment is what Vertex AI sets for a deployed model (``aip_env``). Each
check asks over HTTP and says (passed, what it saw).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from docker.contract import http
from docker.sagemaker_smoke import readable
from frontend.config.vertex import VERTEX_MAX_REQUEST_SIZE
from model_archiver.packaging import ArchiveOptions, build_archive

ROOT = Path(__file__).resolve().parent.parent
HANDLER = ROOT / "tests" / "fixtures" / "vertex" / "sentiment_handler.py"
ENDPOINT, DEPLOYED = "1234567890", "9876543210"
#: Vertex's default routes for a custom container (the prebuilt image gets /ping and
#: /predictions/model, TorchServe's, which the server answers anyway).
HEALTH = f"/v1/endpoints/{ENDPOINT}/deployedModels/{DEPLOYED}"
PREDICT = f"{HEALTH}:predict"
TEXTS = ["good good film", "bad bad bad plot, good cast", "nothing either way"]

Check = Callable[[], tuple[bool, str]]


def aip_env(storage_uri: str, port: int) -> dict[str, str]:
    """What Vertex AI sets for a deployed model (Google's "Custom container requirements")."""
    return {"AIP_HTTP_PORT": str(port), "AIP_HEALTH_ROUTE": HEALTH, "AIP_PREDICT_ROUTE": PREDICT,
            "AIP_STORAGE_URI": storage_uri, "AIP_MODE": "PREDICTION", "AIP_MODE_VERSION": "1.0.0",
            "AIP_ENDPOINT_ID": ENDPOINT, "AIP_DEPLOYED_MODEL_ID": DEPLOYED,
            "AIP_MODEL_NAME": "5555", "AIP_PROJECT_NUMBER": "42", "AIP_FRAMEWORK": "PYTORCH",
            "AIP_MACHINE_TYPE": "n1-standard-4"}


def artifact_folder(root: Path) -> Path:
    """``root/artifacts``: the model's artifact folder as the prebuilt image wants it, its
    weights a ``Linear(2, 2)``: the identity plus 0.5 for "Positive" (``expected``)."""
    build, folder = root / "build", root / "artifacts"
    build.mkdir()
    folder.mkdir()
    weights = torch.nn.Linear(2, 2)
    with torch.no_grad():
        weights.weight.copy_(torch.eye(2))
        weights.bias.copy_(torch.tensor([0.5, 0.0]))
    torch.save(weights.state_dict(), build / "model.pt")
    (build / "index_to_name.json").write_text(json.dumps({"0": "Positive", "1": "Negative"}))
    build_archive(ArchiveOptions(model_name="model", version="1.0",
                                 serialized_file=str(build / "model.pt"), handler=str(HANDLER),
                                 extra_files=(str(build / "index_to_name.json"),),
                                 export_path=folder, force=True))
    readable(root)  # by an image's uid 1000
    return folder


def expected(text: str) -> dict[str, Any]:
    """The model's answer for a text: Positive unless it says "bad" more than "good"."""
    positive = text.count("good") + 0.5 > text.count("bad")
    return {"label": "Positive" if positive else "Negative", "words": len(text.split())}


def b64(text: str) -> dict[str, dict[str, str]]:
    """An instance as Google's samples send text to the prebuilt image."""
    return {"data": {"b64": base64.b64encode(text.encode()).decode()}}


def call(method: str, url: str, body: Any = None, raw: bytes | None = None,
         timeout: float = 60) -> tuple[int, Any]:
    """(status, the JSON answer, else its text): ``body`` sent as JSON, or ``raw`` as it is."""
    return http(method, url, body, timeout=timeout, raw=raw)


def sized_body(size: int) -> bytes:
    """A request body of ``size`` bytes (give or take 5): one long instance."""
    frame = json.dumps({"instances": [""]}).encode()
    return frame.replace(b'""', b'"' + b"good " * ((size - len(frame)) // 5) + b'"')


def contract_checks(base: str) -> list[tuple[str, Check]]:
    """The prebuilt image's contract on Vertex's routes at ``base`` (``http://host:port``)."""

    def health() -> tuple[bool, str]:
        status, body = call("GET", base + HEALTH)
        return (status, body) == (200, {"status": "Healthy"}), f"{status} {body}"

    def predict() -> tuple[bool, str]:
        status, body = call("POST", base + PREDICT, {"instances": [b64(t) for t in TEXTS],
                                                     "parameters": {"top_k": 1}})
        return (status == 200 and body == {"predictions": [expected(t) for t in TEXTS]},
                f"{status} {body}")

    def plain_instances() -> tuple[bool, str]:
        status, body = call("POST", base + PREDICT, {"instances": TEXTS})
        own = call("POST", f"{base}/predictions/model", {"instances": TEXTS})
        wanted = {"predictions": [expected(t) for t in TEXTS]}
        return (status, body) == own == (200, wanted), f"{status} {body}; own route {own}"

    def size_limit() -> tuple[bool, str]:
        under = sized_body(VERTEX_MAX_REQUEST_SIZE - 100)
        status, body = call("POST", base + PREDICT, raw=under)
        served = status == 200 and body["predictions"][0]["words"] == under.count(b"good")
        over_status, over = call("POST", base + PREDICT,
                                 raw=sized_body(VERTEX_MAX_REQUEST_SIZE + 100))
        refused = over_status == 413 and str(VERTEX_MAX_REQUEST_SIZE) in over.get("message", "")
        return served and refused, f"under: {status}; over: {over_status} {over}"

    def bad_requests() -> tuple[bool, str]:
        status, body = call("POST", base + PREDICT, {"rows": [1]})
        method, _ = call("GET", base + PREDICT)
        ok = status == 400 and "instances" in body.get("message", "") and method == 405
        return ok, f"no instances: {status} {body}; GET: {method}"

    return [("the health route answers as /ping", health),
            ("the predict route: base64 instances and parameters, the handler unchanged",
             predict),
            ("the predict route: plain instances, as TorchServe's /predictions/model",
             plain_instances),
            (f"a body over {VERTEX_MAX_REQUEST_SIZE} bytes is 413, one under it is served",
             size_limit),
            ("no instances: 400 naming them; GET on the predict route: 405", bad_requests)]
