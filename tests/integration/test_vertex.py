"""batchserve started as Vertex AI starts its prebuilt PyTorch prediction image: the ``AIP_*``
environment, ``torchserve --start --foreground`` with no model arguments, the model's
artifact folder (``model.mar`` built for the prebuilt image: tests/fixtures/vertex/) as
``AIP_STORAGE_URI`` (a local folder here; ``gs://`` needs Google's library), and real HTTP
clients on ``AIP_HTTP_PORT``, the routes Vertex sends to.

What it proves: the predict route answers ``{"instances": [...], "parameters": {...}}`` with
``{"predictions": [...]}`` through TorchServe's ``json`` envelope, the handler unchanged
(base64 instances decoded, requests at once each answered their own); the health route answers as
``/ping``; a body over Vertex's 1.5 MB is refused with 413 and one under it is served; the
server binds 0.0.0.0, asks for no token and ends with status 0 on SIGTERM; a ``gs://`` URI
without the library, or a folder without ``model.mar``, stops the start with a clear error.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from frontend.config.vertex import VERTEX_MAX_REQUEST_SIZE
from model_archiver.packaging import ArchiveOptions, build_archive
from tests.conftest import ROOT, START_TIMEOUT_S, terminate

TORCHSERVE = Path(sys.executable).parent / "torchserve"
HANDLER = ROOT / "tests" / "fixtures" / "vertex" / "sentiment_handler.py"
ENDPOINT, DEPLOYED = "1234567890", "9876543210"
HEALTH = f"/v1/endpoints/{ENDPOINT}/deployedModels/{DEPLOYED}"
PREDICT = f"{HEALTH}:predict"
TEXTS = ["good good film", "bad bad bad plot, good cast", "nothing either way"]


def expected(text: str) -> dict[str, Any]:
    """The handler's answer for a text: its Linear(2, 2) is the identity plus 0.5 for
    "Positive", so a text is Positive unless it says "bad" more often than "good"."""
    positive = text.count("good") + 0.5 > text.count("bad")
    return {"label": "Positive" if positive else "Negative", "words": len(text.split())}


def b64(text: str) -> dict[str, dict[str, str]]:
    return {"data": {"b64": base64.b64encode(text.encode()).decode()}}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def artifact_folder(root: Path) -> Path:
    """The model's artifact folder as Vertex's prebuilt image wants it: ``model.mar``
    (``--model-name model``) right under it."""
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
    return folder


def aip_env(storage_uri: str, port: int) -> dict[str, str]:
    """What Vertex AI sets for a deployed model (Google's "Custom container requirements")."""
    return {"AIP_HTTP_PORT": str(port), "AIP_HEALTH_ROUTE": HEALTH, "AIP_PREDICT_ROUTE": PREDICT,
            "AIP_STORAGE_URI": storage_uri, "AIP_MODE": "PREDICTION", "AIP_MODE_VERSION": "1.0.0",
            "AIP_ENDPOINT_ID": ENDPOINT, "AIP_DEPLOYED_MODEL_ID": DEPLOYED,
            "AIP_MODEL_NAME": "5555", "AIP_PROJECT_NUMBER": "42", "AIP_FRAMEWORK": "PYTORCH",
            "AIP_MACHINE_TYPE": "n1-standard-4"}


def start(root: Path, env: dict[str, str], *flags: str) -> subprocess.Popen[bytes]:
    """``torchserve --start --foreground`` as the container's command, the other listeners
    on free ports (a config.properties in its working directory, as an image may have)."""
    (root / "config.properties").write_text(
        "management_address=http://127.0.0.1:0\nmetrics_address=http://127.0.0.1:0\n"
        "grpc_inference_port=0\ngrpc_management_port=0\n"
        f"log_location={root / 'logs'}\ndefault_workers_per_model=1\n")
    with (root / "server.log").open("wb") as out:
        return subprocess.Popen(
            [str(TORCHSERVE), "--start", "--foreground", *flags], cwd=root,
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, **env, "BATCHSERVE_STATE_DIR": str(root / "state")})


@dataclass
class Container:
    process: subprocess.Popen[bytes]
    state: dict[str, Any]
    base: str
    log: Path


@pytest.fixture(scope="module")
def vertex(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    root = tmp_path_factory.mktemp("vertex")
    port = free_port()
    process = start(root, aip_env(str(artifact_folder(root)), port))
    log = root / "server.log"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise AssertionError(f"exited {process.returncode}: {log.read_text()[-3000:]}")
        try:
            state = json.loads((root / "state" / "server.json").read_text())
        except (OSError, ValueError):
            state = {}
        if state.get("pid") == process.pid:
            break
        assert time.monotonic() < deadline, "the server did not start in time"
        time.sleep(0.05)
    container = Container(process, state, f"http://127.0.0.1:{port}", log)
    yield container
    assert terminate(process) == 0, log.read_text()[-3000:]


def test_it_serves_on_aip_http_port_of_every_address_without_a_token(vertex: Container
                                                                     ) -> None:
    assert vertex.state["inference"] == vertex.base.replace("127.0.0.1", "0.0.0.0")
    described = requests.get(f"{vertex.state['management']}/models/model", timeout=30)
    assert described.status_code == 200, described.text
    assert described.json()[0]["modelName"] == "model"
    assert "AIP_ENDPOINT_ID=1234567890" in vertex.log.read_text()


def test_the_health_route_answers_as_ping(vertex: Container) -> None:
    answer = requests.get(vertex.base + HEALTH, timeout=30)
    assert (answer.status_code, answer.json()) == (200, {"status": "Healthy"})
    assert requests.get(f"{vertex.base}/ping", timeout=30).status_code == 200


def test_the_predict_route_answers_a_prebuilt_image_model_unchanged(vertex: Container) -> None:
    body = {"instances": [b64(text) for text in TEXTS], "parameters": {"top_k": 1}}
    answer = requests.post(vertex.base + PREDICT, json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"predictions": [expected(text) for text in TEXTS]}
    # Plain string instances are rows as they are; TorchServe's own route says the same.
    plain = requests.post(f"{vertex.base}/predictions/model", json={"instances": TEXTS},
                          timeout=60)
    assert plain.json() == answer.json()


def test_requests_at_once_are_each_answered_their_own(vertex: Container) -> None:
    def ask(text: str) -> Any:
        answer = requests.post(vertex.base + PREDICT, json={"instances": [b64(text)] * 2},
                               timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()

    texts = [f"{'good ' * i}{'bad ' * (5 - i)}" for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, texts))
    assert answers == [{"predictions": [expected(text)] * 2} for text in texts]


def test_a_body_over_vertex_limit_is_refused_and_one_under_it_served(vertex: Container
                                                                    ) -> None:
    def body_of(size: int) -> bytes:
        frame = json.dumps({"instances": [""]}).encode()
        return frame.replace(b'""', b'"' + b"good " * ((size - len(frame)) // 5) + b'"')

    under = body_of(VERTEX_MAX_REQUEST_SIZE - 100)
    answer = requests.post(vertex.base + PREDICT, data=under, timeout=60,
                           headers={"Content-Type": "application/json"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["predictions"][0]["words"] == under.count(b"good")
    over = body_of(VERTEX_MAX_REQUEST_SIZE + 100)
    refused = requests.post(vertex.base + PREDICT, data=over, timeout=60,
                            headers={"Content-Type": "application/json"})
    assert refused.status_code == 413
    assert str(VERTEX_MAX_REQUEST_SIZE) in refused.json()["message"]


def test_a_bad_body_and_a_wrong_method_get_clear_errors(vertex: Container) -> None:
    answer = requests.post(vertex.base + PREDICT, json={"rows": [1]}, timeout=60)
    assert answer.status_code == 400
    assert "instances" in answer.json()["message"]
    assert requests.get(vertex.base + PREDICT, timeout=30).status_code == 405


def failed_start(root: Path, env: dict[str, str]) -> str:
    process = start(root, env)
    assert process.wait(timeout=START_TIMEOUT_S) == 2
    return (root / "server.log").read_text()


def test_a_gs_uri_without_google_storage_library_is_a_clear_error(tmp_path: Path) -> None:
    # Whether or not the library is installed here, this start cannot import it.
    blocker = tmp_path / "blocker" / "google" / "cloud" / "storage"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('no google-cloud-storage')\n")
    path = os.pathsep.join(filter(None, [str(tmp_path / "blocker"),
                                         os.environ.get("PYTHONPATH")]))
    log = failed_start(tmp_path, {**aip_env("gs://bucket/models/m1", free_port()),
                                  "PYTHONPATH": path})
    assert "AIP_STORAGE_URI='gs://bucket/models/m1'" in log
    assert "pip install 'batchserve[vertex]' (google-cloud-storage)" in log


def test_a_storage_folder_without_model_mar_is_a_clear_error(tmp_path: Path) -> None:
    empty = tmp_path / "artifacts"
    empty.mkdir()
    log = failed_start(tmp_path, aip_env(str(empty), free_port()))
    assert f"no model.mar in {empty}" in log
