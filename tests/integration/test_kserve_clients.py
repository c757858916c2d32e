"""KServe's and Triton's own clients against the real server, and KServe v1's batcher under load.

One server for the module, with two models:

- ``affine``: a small torch model (``OUTPUT0 = 2 * INPUT0 + 1``, FP32, shape ``[n, 4]``) served by
  a v2-aware handler (tests/fixtures/handlers/affine_v2.py), its tensors declared in the archive's
  model-config.yaml; the real ``tritonclient`` talks to it over HTTP (JSON and binary tensors)
  and gRPC (raw contents).
- ``probe``: a KServe v1 model batched as KServe's batcher (``maxBatchSize: 8``, ``maxLatency:
  500``, fixed policy so concurrent requests meet) whose handler
  (tests/fixtures/handlers/v1_batch_probe.py) reports, with each prediction, the batch it rode in.

``tritonclient.grpc`` runs in a child process: its generated ``grpc_service.proto`` defines the
same ``inference.*`` messages as our ``protos/open_inference.proto``, and protobuf refuses two
files defining one symbol in a process's default descriptor pool (whichever is imported second
fails: "duplicate symbol 'inference.ServerLiveRequest'"). So this module never imports it; the
child does the calls and reports what it got as JSON. (The ``grpc`` extra of tritonclient also
pins protobuf<7, which this project cannot take; ``tritonclient[http]`` is installed, and the
gRPC client works with the protobuf 7 and grpcio this project already has.)

MLServer's merge/split of parameters (the reference document's example) is reproduced by
tests/unit/test_open_inference.py (``test_mlservers_parameter_merge``,
``test_mlservers_batched_output_is_split_back_per_request``) and, through the real server, by
tests/integration/test_kserve.py (``test_v2_requests_merge_into_one_batch_and_split_back``).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from numpy.testing import assert_allclose

from model_archiver.packaging import ArchiveOptions, build_archive
from tests.conftest import HANDLERS, RunningServer, launch_server

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402 (after the guard)

AFFINE_CONFIG = """
inputs:
  - {name: INPUT0, datatype: FP32, shape: [-1, 4]}
outputs:
  - {name: OUTPUT0, datatype: FP32, shape: [-1, 4]}
"""
PROBE_CONFIG = "maxBatchSize: 8\nmaxLatency: 500\nbatchPolicy: fixed\n"
MAX_BATCH_SIZE = 8
TENSOR_METADATA = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]}],
                   "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 4]}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("kserve_clients")
    store = root / "model_store"
    store.mkdir()
    for name, handler, config in (("affine", "affine_v2", AFFINE_CONFIG),
                                  ("probe", "v1_batch_probe", PROBE_CONFIG)):
        config_file = root / f"{name}.yaml"
        config_file.write_text(config)
        build_archive(ArchiveOptions(model_name=name, handler=str(HANDLERS / f"{handler}.py"),
                                     export_path=store, force=True,
                                     config_file=str(config_file)))
    running = launch_server(store, "affine.mar", "probe.mar")
    yield running
    running.stop()


def _inputs(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-10, 10, size=(rows, 4)).astype(np.float32)


def _expected(x: np.ndarray) -> np.ndarray:
    return (2 * x + 1).astype(np.float32)


# ---- tritonclient over HTTP -------------------------------------------------------------------


@pytest.fixture
def http_client(server: RunningServer) -> Iterator[Any]:
    client = httpclient.InferenceServerClient(url=server.inference.removeprefix("http://"))
    yield client
    client.close()


def test_tritonclient_http_health_and_metadata(http_client: Any) -> None:
    assert http_client.is_server_live()
    assert http_client.is_server_ready()
    assert http_client.is_model_ready("affine")
    assert http_client.is_model_ready("affine", "1.0")
    assert not http_client.is_model_ready("nope")

    server_metadata = http_client.get_server_metadata()
    assert server_metadata["name"] == "batchserve" and server_metadata["version"]
    assert "binary_tensor_data" in server_metadata["extensions"]

    assert http_client.get_model_metadata("affine") == {
        "name": "affine", "versions": ["1.0"], "platform": "pytorch", **TENSOR_METADATA}
    assert http_client.get_model_metadata("affine", "1.0")["name"] == "affine"
    with pytest.raises(InferenceServerException):
        http_client.get_model_metadata("nope")


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_http_infer(http_client: Any, binary: bool) -> None:
    x = _inputs(3, seed=1 + binary)
    infer_input = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    infer_input.set_data_from_numpy(x, binary_data=binary)
    requested = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)

    result = http_client.infer("affine", [infer_input], outputs=[requested],
                               request_id=f"http-{binary}")

    response = result.get_response()
    assert response["id"] == f"http-{binary}"
    assert (response["model_name"], response["model_version"]) == ("affine", "1.0")
    output = result.get_output("OUTPUT0")
    assert (output["datatype"], output["shape"]) == ("FP32", [3, 4])
    if binary:  # the tensor came back as binary data after the JSON header, not as JSON
        assert "data" not in output
        assert output["parameters"]["binary_data_size"] == x.nbytes
    else:
        assert "data" in output and "binary_data_size" not in output.get("parameters", {})
    y = result.as_numpy("OUTPUT0")
    assert y.dtype == np.float32 and y.shape == (3, 4)
    assert_allclose(y, _expected(x), rtol=1e-6)


def test_tritonclient_http_errors(http_client: Any) -> None:
    x = _inputs(2, seed=3)
    wrong_name = httpclient.InferInput("INPUT0", [2, 4], "FP32")
    wrong_name.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException):
        http_client.infer("nope", [wrong_name])
    with pytest.raises(InferenceServerException, match="OUTPUT9"):
        http_client.infer("affine", [wrong_name],
                          outputs=[httpclient.InferRequestedOutput("OUTPUT9")])


# ---- tritonclient over gRPC (in a child process: see the module's docstring) ------------------

GRPC_CLIENT = """
import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

url, model, values = sys.argv[1], sys.argv[2], sys.argv[3]
x = np.array(json.loads(values), dtype=np.float32)


def tensors(entries):
    return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in entries]


client = grpcclient.InferenceServerClient(url=url)
try:
    report = {
        "live": client.is_server_live(),
        "ready": client.is_server_ready(),
        "model_ready": client.is_model_ready(model),
        "version_ready": client.is_model_ready(model, "1.0"),
    }
    server_metadata = client.get_server_metadata()
    report["server_metadata"] = {"name": server_metadata.name,
                                 "extensions": list(server_metadata.extensions)}
    metadata = client.get_model_metadata(model)
    report["model_metadata"] = {
        "name": metadata.name, "versions": list(metadata.versions),
        "platform": metadata.platform, "inputs": tensors(metadata.inputs),
        "outputs": tensors(metadata.outputs)}

    infer_input = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
    infer_input.set_data_from_numpy(x)  # tritonclient.grpc sends raw_input_contents
    result = client.infer(model, [infer_input], request_id="grpc-1",
                          outputs=[grpcclient.InferRequestedOutput("OUTPUT0")])
    response = result.get_response()
    y = result.as_numpy("OUTPUT0")
    report["response"] = {
        "id": response.id, "model_name": response.model_name,
        "model_version": response.model_version,
        "outputs": tensors(response.outputs),
        "raw_output_contents": [len(blob) for blob in response.raw_output_contents],
        "typed_contents": [o.HasField("contents") for o in response.outputs],
        "y": y.tolist(), "dtype": str(y.dtype), "shape": list(y.shape)}

    try:
        client.infer("nope", [infer_input])
        report["missing_model"] = "no error"
    except InferenceServerException as exc:
        report["missing_model"] = exc.status()
finally:
    client.close()
print(json.dumps(report))
"""


def test_tritonclient_grpc_health_metadata_and_raw_infer(server: RunningServer,
                                                          tmp_path: Path) -> None:
    x = _inputs(5, seed=4)
    child = subprocess.run(
        [sys.executable, "-c", GRPC_CLIENT, f"127.0.0.1:{server.grpc_inference_port}",
         "affine", json.dumps(x.tolist())],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout)

    assert (report["live"], report["ready"]) == (True, True)
    assert (report["model_ready"], report["version_ready"]) == (True, True)
    assert report["server_metadata"]["name"] == "batchserve"
    assert "binary_tensor_data" in report["server_metadata"]["extensions"]
    assert report["model_metadata"] == {
        "name": "affine", "versions": ["1.0"], "platform": "pytorch", **TENSOR_METADATA}

    response = report["response"]
    assert (response["id"], response["model_name"], response["model_version"]) == (
        "grpc-1", "affine", "1.0")
    assert response["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32", "shape": [5, 4]}]
    # Raw contents in, raw contents out: no typed contents in the answer.
    assert response["raw_output_contents"] == [x.nbytes]
    assert response["typed_contents"] == [False]
    assert (response["dtype"], response["shape"]) == ("float32", [5, 4])
    assert_allclose(np.array(response["y"], dtype=np.float32), _expected(x), rtol=1e-6)

    assert report["missing_model"] == "StatusCode.NOT_FOUND"


# ---- KServe v1: instance batching under concurrency -------------------------------------------


def test_v1_concurrent_requests_share_batches_and_get_exactly_their_own_predictions(
        server: RunningServer) -> None:
    rng = random.Random(20261122)
    bodies = [[100 * request + item for item in range(rng.randint(1, 3))]
              for request in range(20)]
    start = threading.Barrier(len(bodies))

    def predict(instances: list[int]) -> requests.Response:
        start.wait(timeout=30)
        return requests.post(f"{server.inference}/v1/models/probe:predict",
                             json={"instances": instances}, timeout=60)

    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = [answer for answer in pool.map(predict, bodies)]

    members: defaultdict[str, list[int]] = defaultdict(list)  # batchId -> request indexes
    predictions: list[list[dict[str, Any]]] = []
    for index, (instances, answer) in enumerate(zip(bodies, answers, strict=True)):
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert set(body) == {"predictions", "batchId"} and body["batchId"], body
        # Exactly its own predictions, in order.
        assert [p["instance"] for p in body["predictions"]] == instances, body
        predictions.append(body["predictions"])
        members[body["batchId"]].append(index)

    handler_calls = set()
    for batch_id, indexes in members.items():
        rows = sum(len(bodies[i]) for i in indexes)
        seen = {(p["call"], p["batch_rows"]) for i in indexes for p in predictions[i]}
        # One handler call per batchId, and that call held exactly these requests' instances:
        # requests that shared a batch carry its batchId (and no other request does).
        assert len(seen) == 1, (batch_id, seen)
        (call, batch_rows), = seen
        assert batch_rows == rows, (batch_id, batch_rows, [bodies[i] for i in indexes])
        assert call not in handler_calls, (batch_id, call)
        handler_calls.add(call)
        assert rows <= MAX_BATCH_SIZE or len(indexes) == 1, (batch_id, rows)
    # The requests did meet: some batch held instances of more than one request.
    assert max(len(indexes) for indexes in members.values()) > 1, dict(members)
    assert sum(len(instances) for instances in bodies) == sum(
        predictions[indexes[0]][0]["batch_rows"] for indexes in members.values())
