"""batchserve started exactly as KServe's ``kserve-torchserve`` runtime starts TorchServe, and
driven by real clients.

The runtime (kserve/kserve ``config/runtimes/kserve-torchserve.yaml``) runs ``torchserve --start
--model-store=/mnt/models/model-store --ts-config=/mnt/models/config/config.properties`` with
``TS_SERVICE_ENVELOPE`` (``kserve``, or ``kservev2`` for v2 and grpc-v2) and
``PROTOCOL_VERSION`` in the environment, and sends REST to 8080 and gRPC to 8081. Here the
``/mnt/models`` layout is a temporary folder, ``config.properties`` is KServe's documented file
(tests/fixtures/kserve/config.properties) with only its ports moved to free ones, KServe's two
ports are moved with ``TS_KSERVE_REST_PORT``/``TS_KSERVE_GRPC_PORT`` (its ``enable_envvars_config``
is on), and ``BATCHSERVE_FOREGROUND=1`` stands for the container (the test is not PID 1). The
model is the snapshot's ``mnist``: a tiny image classifier (the built-in ``image_classifier``
handler), asked with the request shapes of KServe's TorchServe docs (base64 images).

tritonclient speaks v2 REST and gRPC. The ``kserve`` Python package cannot join this project's
environment (kserve 0.21 requires protobuf<7 and psutil<6; this project runs protobuf 7 and
psutil 7), so its clients run from another interpreter when ``KSERVE_PYTHON`` names one that
has it (``python -m venv kv && kv/bin/pip install kserve``); otherwise that test is skipped.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from frontend.config import Address
from model_archiver.packaging import ArchiveOptions, build_archive
from tests.conftest import HANDLERS, START_TIMEOUT_S, launch_server, terminate
from tests.integration.vision_fixtures import build_tiny_classifier, jpeg

httpclient = pytest.importorskip("tritonclient.http")

KSERVE_CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "kserve" / "config.properties"
TORCHSERVE = Path(sys.executable).parent / "torchserve"
IMAGE = jpeg(3)
IMAGE_B64 = base64.b64encode(IMAGE).decode()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def kserve_config(**extra: str) -> str:
    """KServe's documented config.properties, its ports moved to free ones (inference and
    management stay on one port, as documented), plus ``extra`` keys."""
    text = KSERVE_CONFIG.read_text()
    port = free_port()
    for documented, moved in (("0.0.0.0:8085", f"0.0.0.0:{port}"), ("0.0.0.0:8082", "0.0.0.0:0"),
                              ("grpc_inference_port=7070", "grpc_inference_port=0"),
                              ("grpc_management_port=7071", "grpc_management_port=0")):
        assert documented in text
        text = text.replace(documented, moved)
    return text + "".join(f"{key}={value}\n" for key, value in extra.items())


@dataclass
class Pod:
    """A server started as KServe's runtime starts it, and where it answers."""

    process: subprocess.Popen[bytes]
    state: dict[str, Any]
    stdout: Path
    stderr: Path

    @property
    def rest(self) -> str:
        return self.url("kserve_rest")

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.state['kserve_grpc_port']}"

    def url(self, address_key: str) -> str:
        return str(self.state[address_key]).replace("0.0.0.0", "127.0.0.1")

    def stop(self) -> int:
        return terminate(self.process)


def start_pod(root: Path, envelope: str, protocol: str, config: str,
              models: dict[str, Path]) -> Pod:
    """``torchserve --start`` with KServe's args and env on ``root/mnt/models``."""
    mnt = root / "mnt" / "models"
    (mnt / "config").mkdir(parents=True)
    store = mnt / "model-store"
    store.mkdir()
    for name, archive in models.items():
        archive.rename(store / f"{name}.mar")
    (mnt / "config" / "config.properties").write_text(config)
    state_dir = root / "state"
    env = {**os.environ, "TS_SERVICE_ENVELOPE": envelope, "PROTOCOL_VERSION": protocol,
           "TS_KSERVE_REST_PORT": "0", "TS_KSERVE_GRPC_PORT": "0",
           "BATCHSERVE_FOREGROUND": "1", "BATCHSERVE_STATE_DIR": str(state_dir)}
    stdout, stderr = root / "stdout.log", root / "stderr.log"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        process = subprocess.Popen(
            [str(TORCHSERVE), "--start", f"--model-store={store}",
             f"--ts-config={mnt / 'config' / 'config.properties'}"],
            cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
    deadline = time.monotonic() + START_TIMEOUT_S * 2
    while True:
        if process.poll() is not None:
            raise AssertionError(f"torchserve --start exited with {process.returncode}:\n"
                                 f"{stdout.read_text()[-3000:]}{stderr.read_text()[-3000:]}")
        try:
            state = json.loads((state_dir / "server.json").read_text())
        except (OSError, ValueError):
            state = {}
        # The process KServe started is the server itself: --start stayed in the foreground.
        if state.get("pid") == process.pid:
            return Pod(process, state, stdout, stderr)
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("the server did not start in time")
        time.sleep(0.05)


def mnist_archive(root: Path) -> dict[str, Path]:
    build = root / "build"
    build.mkdir()
    return {"mnist": build_tiny_classifier(build, name="mnist")}


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """The tiny classifier's answer for IMAGE, through TorchServe's own route."""
    root = tmp_path_factory.mktemp("plain")
    pod = start_pod(root, "", "v1", kserve_config(), mnist_archive(root))
    try:
        answer = requests.post(f"{pod.url('inference')}/predictions/mnist", data=IMAGE,
                               timeout=60)
        assert answer.status_code == 200, answer.text
        return dict(answer.json())
    finally:
        assert pod.stop() == 0


def _pod(tmp_path_factory: pytest.TempPathFactory, envelope: str, protocol: str
         ) -> Iterator[Pod]:
    root = tmp_path_factory.mktemp(f"pod-{envelope or 'none'}-{protocol}")
    pod = start_pod(root, envelope, protocol, kserve_config(), mnist_archive(root))
    yield pod
    assert pod.stop() == 0, pod.stdout.read_text()[-3000:]


@pytest.fixture(scope="module")
def v1_pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    yield from _pod(tmp_path_factory, "kserve", "v1")


@pytest.fixture(scope="module")
def v2_pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    yield from _pod(tmp_path_factory, "kservev2", "grpc-v2")


@pytest.fixture(scope="module")
def native_v2_pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    # A predictor without the serviceEnvelope label: the runtime sets TS_SERVICE_ENVELOPE="".
    yield from _pod(tmp_path_factory, "", "v2")


def assert_same(prediction: dict[str, float], expected: dict[str, float]) -> None:
    assert list(prediction) == list(expected)
    assert np.allclose(list(prediction.values()), list(expected.values()), atol=1e-5)


# ---- v1 (TS_SERVICE_ENVELOPE=kserve, PROTOCOL_VERSION=v1) -------------------------------------


def test_v1_on_kserves_rest_port(v1_pod: Pod, expected: dict[str, float]) -> None:
    rest = v1_pod.rest
    assert rest != v1_pod.url("inference")  # a listener of its own, beside 8085's
    # KServe's model server routes: liveness, the model list and status, no token asked.
    assert requests.get(f"{rest}/", timeout=30).json() == {"status": "alive"}
    assert requests.get(f"{rest}/v1/models", timeout=30).json() == {"models": ["mnist"]}
    assert requests.get(f"{rest}/v1/models/mnist", timeout=30).json() == {
        "name": "mnist", "ready": True}
    assert requests.get(f"{rest}/v1/models/ghost", timeout=30).status_code == 404

    # The request of KServe's TorchServe docs: {"instances": [{"data": "<base64 image>"}]}.
    answer = requests.post(f"{rest}/v1/models/mnist:predict",
                           json={"instances": [{"data": IMAGE_B64}]}, timeout=60)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert list(body) == ["predictions"]  # TorchServe's envelope answer, nothing added
    (prediction,) = body["predictions"]
    assert_same(prediction, expected)
    # The docs' own command, curl -d @mnist.json, sends it as a form (no JSON content type).
    as_curl = requests.post(f"{rest}/v1/models/mnist:predict",
                            data=json.dumps({"instances": [{"data": IMAGE_B64}]}),
                            headers={"Content-Type": "application/x-www-form-urlencoded"},
                            timeout=60)
    assert as_curl.status_code == 200 and as_curl.json() == body

    explained = requests.post(f"{rest}/v1/models/mnist:explain",
                              json={"instances": [{"data": IMAGE_B64}]}, timeout=120)
    if explained.status_code != 501:  # 501: Captum is not installed
        assert explained.status_code == 200, explained.text
        assert list(explained.json()) == ["explanations"]

    # The envelope takes the body on every route, as in TorchServe: /predictions too.
    same = requests.post(f"{v1_pod.url('inference')}/predictions/mnist",
                         json={"instances": [{"data": IMAGE_B64}, {"data": IMAGE_B64}]},
                         timeout=60)
    assert same.status_code == 200 and len(same.json()["predictions"]) == 2

    bad = requests.post(f"{rest}/v1/models/mnist:predict", json={"inputs": []}, timeout=60)
    assert bad.status_code == 400 and "instances" in bad.json()["error"]


def test_the_runtime_logs_to_stdout_and_serves_prometheus_metrics(v1_pod: Pod) -> None:
    assert "KServe (PROTOCOL_VERSION=v1)" in v1_pod.stdout.read_text()
    # KServe's documented config names metrics_format=prometheus; no unknown-key warning.
    assert "unknown key" not in v1_pod.stdout.read_text() + v1_pod.stderr.read_text()
    metrics = requests.get(f"{v1_pod.url('metrics')}/metrics", timeout=30)
    assert metrics.status_code == 200 and "batchserve_queue_depth" in metrics.text


# ---- v2 and grpc-v2 (TS_SERVICE_ENVELOPE=kservev2) -------------------------------------------


def test_v2_rest_through_the_kservev2_envelope(v2_pod: Pod, expected: dict[str, float]) -> None:
    # KServe's mnist_v2_bytes.json shape: one BYTES input holding base64 text.
    request = {"id": "d3b15cad", "inputs": [{"name": "input-0", "shape": [1],
                                              "datatype": "BYTES", "data": [IMAGE_B64]}]}
    answer = requests.post(f"{v2_pod.rest}/v2/models/mnist/infer", json=request, timeout=60)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    # TorchServe's kservev2 answer: the request's id, the archive's name and version, output i
    # named after input i.
    assert list(body) == ["id", "model_name", "model_version", "outputs"]
    assert (body["id"], body["model_name"], body["model_version"]) == ("d3b15cad", "mnist", "1.0")
    (output,) = body["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == ("input-0", "BYTES", [1])
    assert_same(output["data"][0], expected)


def test_tritonclient_http_on_kserves_rest_port(v2_pod: Pod, expected: dict[str, float]) -> None:
    client = httpclient.InferenceServerClient(url=v2_pod.rest.removeprefix("http://"))
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("mnist") and not client.is_model_ready("ghost")
        image = httpclient.InferInput("data", [1], "BYTES")
        image.set_data_from_numpy(np.array([IMAGE_B64.encode()], dtype=np.object_),
                                  binary_data=False)
        result = client.infer("mnist", [image], request_id="triton-1")
    finally:
        client.close()
    response = result.get_response()
    assert response["id"] == "triton-1"
    assert_same(response["outputs"][0]["data"][0], expected)


GRPC_CLIENT = """
import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient

url, image_path = sys.argv[1], sys.argv[2]
client = grpcclient.InferenceServerClient(url=url)
try:
    image = grpcclient.InferInput("data", [1], "BYTES")
    # The image's own bytes: the wrapper (and so the envelope) base64-encodes them.
    image.set_data_from_numpy(np.array([open(image_path, "rb").read()], dtype=np.object_))
    result = client.infer("mnist", [image], request_id="grpc-1")
    response = result.get_response()
    print(json.dumps({
        "live": client.is_server_live(), "ready": client.is_server_ready(),
        "model_ready": client.is_model_ready("mnist"),
        "id": response.id, "model_name": response.model_name,
        "outputs": [[o.name, o.datatype, list(o.shape)] for o in response.outputs],
        "data": [json.loads(item) for item in result.as_numpy("data")],
    }))
finally:
    client.close()
"""


def test_tritonclient_grpc_on_kserves_grpc_port(v2_pod: Pod, expected: dict[str, float],
                                                tmp_path: Path) -> None:
    """tritonclient.grpc in a child process (tests/integration/test_kserve_clients.py says
    why), against the Open Inference service on KServe's gRPC port (8081, its h2c port)."""
    image = tmp_path / "image.jpg"
    image.write_bytes(IMAGE)
    child = subprocess.run([sys.executable, "-c", GRPC_CLIENT, v2_pod.grpc, str(image)],
                           capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout)
    assert (report["live"], report["ready"], report["model_ready"]) == (True, True, True)
    assert (report["id"], report["model_name"]) == ("grpc-1", "mnist")
    assert report["outputs"] == [["data", "BYTES", [1]]]
    assert_same(report["data"][0], expected)


KSERVE_CLIENTS = """
import asyncio
import base64
import json
import sys

from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig

rest, grpc_url, image_path, protocol = sys.argv[1:5]
image = open(image_path, "rb").read()
text = base64.b64encode(image).decode()


async def v1():
    client = InferenceRESTClient(RESTConfig(protocol="v1"))
    try:
        answer = await client.infer(rest, {"instances": [{"data": text}]}, model_name="mnist")
        return [await client.is_server_live(rest), await client.is_model_ready(rest, "mnist"),
                answer]
    finally:
        await client.close()


async def v2():
    client = InferenceRESTClient(RESTConfig(protocol="v2"))
    try:
        request = InferRequest(model_name="mnist", request_id="k-rest", infer_inputs=[
            InferInput(name="input-0", shape=[1], datatype="BYTES", data=[text])])
        answer = await client.infer(rest, request, model_name="mnist")
        return [await client.is_server_ready(rest), await client.is_model_ready(rest, "mnist"),
                answer.id, [[o.name, o.datatype, o.shape] for o in answer.outputs]]
    finally:
        await client.close()


async def grpc():
    client = InferenceGRPCClient(url=grpc_url)
    try:
        request = InferRequest(model_name="mnist", request_id="k-grpc", infer_inputs=[
            InferInput(name="input-0", shape=[1], datatype="BYTES", data=[image])])
        answer = await client.infer(request)
        return [await client.is_server_ready(), await client.is_model_ready("mnist"),
                answer.id, [[o.name, o.datatype, o.shape] for o in answer.outputs],
                json.loads(answer.outputs[0].data[0])]
    finally:
        await client.close()


async def main():
    if protocol == "v1":
        print(json.dumps({"v1": await v1()}))
    else:
        print(json.dumps({"v2": await v2(), "grpc": await grpc()}))


asyncio.run(main())
"""


@pytest.mark.skipif(not os.environ.get("KSERVE_PYTHON"),
                    reason="KSERVE_PYTHON names no interpreter with the kserve package")
def test_kserves_own_clients(v1_pod: Pod, v2_pod: Pod, expected: dict[str, float],
                             tmp_path: Path) -> None:
    image = tmp_path / "image.jpg"
    image.write_bytes(IMAGE)

    def run(pod: Pod, protocol: str) -> dict[str, Any]:
        child = subprocess.run([os.environ["KSERVE_PYTHON"], "-c", KSERVE_CLIENTS, pod.rest,
                                pod.grpc, str(image), protocol],
                               capture_output=True, text=True, timeout=120, check=False)
        assert child.returncode == 0, child.stderr
        return dict(json.loads(child.stdout.splitlines()[-1]))

    live, ready, answer = run(v1_pod, "v1")["v1"]
    assert (live, ready) == (True, True)
    assert_same(answer["predictions"][0], expected)
    report = run(v2_pod, "v2")
    assert report["v2"] == [True, True, "k-rest", [["input-0", "BYTES", [1]]]]
    ready, model_ready, answer_id, outputs, prediction = report["grpc"]
    assert (ready, model_ready, answer_id, outputs) == (
        True, True, "k-grpc", [["input-0", "BYTES", [1]]])
    assert_same(prediction, expected)


# ---- v2 without an envelope (batchserve's own v2) ---------------------------------------------


def test_native_v2_takes_a_base64_image_in_a_bytes_tensor(native_v2_pod: Pod,
                                                          expected: dict[str, float]) -> None:
    request = {"inputs": [{"name": "input-0", "shape": [1], "datatype": "BYTES",
                           "data": [IMAGE_B64]}]}
    answer = requests.post(f"{native_v2_pod.rest}/v2/models/mnist/infer", json=request,
                           timeout=60)
    assert answer.status_code == 200, answer.text
    outputs = {o["name"]: o["data"][0] for o in answer.json()["outputs"]}
    assert_same(outputs, expected)


# ---- readiness and draining -------------------------------------------------------------------


def test_a_startup_model_that_fails_to_load_keeps_the_server_not_ready(tmp_path: Path) -> None:
    """The snapshot names ``mnist``, whose archive is not there: KServe's readiness says no."""
    pod = start_pod(tmp_path, "kserve", "v2", kserve_config(), {})
    try:
        ready = requests.get(f"{pod.rest}/v2/health/ready", timeout=30)
        assert (ready.status_code, ready.json()) == (503, {"ready": False})
        assert requests.get(f"{pod.rest}/v1/models/mnist", timeout=30).status_code == 404
    finally:
        assert pod.stop() == 0


GATE_SNAPSHOT = ('model_snapshot={"name":"startup.cfg","modelCount":1,"models":{"gate":{"1.0":'
                 '{"defaultVersion":true,"marName":"gate.mar","minWorkers":1,"maxWorkers":1,'
                 '"batchSize":1,"maxBatchDelay":10,"responseTimeout":120}}}}')


def gate_pod(root: Path, **extra: str) -> Pod:
    """KServe's config serving the ``gate`` fixture handler (a request waits in the worker
    until the file its body names exists)."""
    build = root / "build"
    build.mkdir()
    archive = build_archive(ArchiveOptions(model_name="gate", handler=str(HANDLERS / "gate.py"),
                                           export_path=build, force=True))
    config = "\n".join(GATE_SNAPSHOT if line.startswith("model_snapshot=") else line
                       for line in kserve_config(**extra).splitlines()) + "\n"
    return start_pod(root, "", "v1", config, {"gate": archive})


def wait_until(predicate: Any, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def refuses_connections(url: str) -> bool:
    try:
        requests.get(f"{url}/ping", timeout=2)
    except requests.ConnectionError:
        return True
    return False


def in_flight(pod: Pod) -> bool:
    described = requests.get(f"{pod.url('management')}/models/gate", timeout=30).json()[0]
    return bool(described["batching"]["inFlightBatches"] == 1)


def test_sigterm_drains_a_request_in_flight_then_exits(tmp_path: Path) -> None:
    pod = gate_pod(tmp_path)
    gate = tmp_path / "open"
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(requests.post, f"{pod.rest}/predictions/gate",
                           data=str(gate).encode(), timeout=120)
        wait_until(lambda: in_flight(pod), "the request to reach the worker")
        pod.process.send_signal(signal.SIGTERM)
        # No new connections once draining...
        wait_until(lambda: refuses_connections(pod.rest), "the listener to close")
        assert pod.process.poll() is None  # ...while the open request is still being served
        gate.touch()
        answer = held.result(timeout=60)
    assert (answer.status_code, answer.content) == (200, str(gate).encode())
    assert pod.process.wait(timeout=60) == 0


def test_drain_timeout_bounds_the_stop(tmp_path: Path) -> None:
    """A request that never finishes does not hold the stop past drain_timeout: the pod
    exits inside Kubernetes' grace period (30 s) instead of being killed."""
    pod = gate_pod(tmp_path, drain_timeout="2")
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(requests.post, f"{pod.rest}/predictions/gate",
                           data=str(tmp_path / "never").encode(), timeout=120)
        wait_until(lambda: in_flight(pod), "the request to reach the worker")
        pod.process.send_signal(signal.SIGTERM)
        assert pod.process.wait(timeout=25) == 0
        try:
            answered = held.result(timeout=30).status_code
        except requests.ConnectionError:
            answered = 0  # the connection was closed: the client is not left hanging
    assert answered != 200
    assert "drain_timeout" in pod.stdout.read_text()


# ---- where KServe's ports land when they are configured ports too -----------------------------


def test_kserves_ports_share_the_listeners_that_serve_the_same(tmp_path: Path) -> None:
    """KServe's REST port on the inference address is that listener; on the management
    address, one listener serves both APIs (TorchServe's rule for coinciding addresses); its
    gRPC port on the gRPC inference port is that listener."""
    store = tmp_path / "store"
    store.mkdir()
    inference, management, grpc_port = free_port(), free_port(), free_port()
    server = launch_server(store, inference_address=Address("127.0.0.1", inference),
                           kserve_protocol="v1", kserve_rest_port=inference,
                           grpc_inference_port=grpc_port, kserve_grpc_port=grpc_port)
    try:
        assert server.server.bound is not None
        assert str(server.server.bound.kserve_rest) == server.inference
        assert server.server.bound.kserve_grpc_port == server.grpc_inference_port == grpc_port
    finally:
        server.stop()

    server = launch_server(store, management_address=Address("127.0.0.1", management),
                           kserve_protocol="v1", kserve_rest_port=management, kserve_grpc_port=0)
    try:
        assert server.server.bound is not None
        shared = str(server.server.bound.kserve_rest)
        assert shared == server.management != server.inference
        assert requests.get(f"{shared}/v1/models", timeout=30).json() == {"models": []}
        assert requests.get(f"{shared}/models", timeout=30).json() == {"models": []}
    finally:
        server.stop()
