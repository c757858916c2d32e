"""batchserve started as Vertex AI starts its prebuilt PyTorch prediction image: the ``AIP_*``
environment, ``torchserve --start --foreground`` with no model arguments, the model's
artifact folder (``model.mar`` built for the prebuilt image: tests/fixtures/vertex/) as
``AIP_STORAGE_URI`` (a local folder here; ``gs://`` needs Google's library), and real HTTP
clients on ``AIP_HTTP_PORT``, the routes Vertex sends to.

What it proves, with the checks the image's smoke test runs (docker/vertex_contract.py): the
predict route answers ``{"instances": [...], "parameters": {...}}`` with ``{"predictions":
[...]}`` through TorchServe's ``json`` envelope, the handler unchanged (base64 and plain
instances); the health route answers as ``/ping``; a body over Vertex's 1.5 MB is refused with
413 and one under it is served; a body without instances is 400, a GET 405. And: requests at
once are each answered their own; the server binds 0.0.0.0, asks for no token and ends with
status 0 on SIGTERM; a ``gs://`` URI without the library, or a folder without ``model.mar``,
stops the start with a clear error.
"""

from __future__ import annotations

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

from docker.vertex_contract import PREDICT, aip_env, artifact_folder, b64, contract_checks, expected
from tests.conftest import START_TIMEOUT_S, terminate

TORCHSERVE = Path(sys.executable).parent / "torchserve"
CHECKS = [name for name, _ in contract_checks("http://unused")]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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


@pytest.mark.parametrize("name", CHECKS)
def test_the_image_smoke_test_contract_holds(vertex: Container, name: str) -> None:
    """The checks docker/vertex_smoke.py runs on the image, each on the real server."""
    check = dict(contract_checks(vertex.base))[name]
    ok, saw = check()
    assert ok, saw


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
