"""batchserve started exactly as SageMaker's PyTorch inference containers start TorchServe:
by the real SageMaker inference toolkit's ``serve`` (``sagemaker-pytorch-inference`` 2.0.25,
which carries ``sagemaker_inference``), unchanged, serving a user's ``inference.py``.

The toolkit lives in its own venv (``.venv-sagemaker``, made by ``make test``), as it lives in
the container beside the server: this test adds batchserve's environment to that venv's path
and a ``torchserve`` entry point to its ``bin/``, as ``pip install batchserve`` would there.
The toolkit runs as it does in the container, with two moves: ``SAGEMAKER_BASE_DIR`` points
it at a temporary ``/opt/ml`` layout, and the config file it writes to
``/etc/sagemaker-ts.properties`` is written into the test's folder instead (its module
constant ``TS_CONFIG_FILE``; nothing else of it is touched). The ports it does not set
(gRPC, metrics) are moved to free ones with ``TS_*`` variables, which its config allows
(``enable_envvars_config=true``).

Single model: ``/invocations`` with JSON and NPY bodies, ``SAGEMAKER_TS_*`` in describe,
batches formed through the user's ``batch_predict_fn``, requests of one batch never mixed
up, SIGTERM to ``serve`` draining an answer in flight and exiting 0. Multi-model
(``SAGEMAKER_MULTI_MODEL=true``): two models registered, invoked and unregistered through the
management API as SageMaker does, one of them answering batches per request through the
toolkit's own ``handle``.
"""

from __future__ import annotations

import functools
import io
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import requests
import torch

REPO = Path(__file__).resolve().parents[2]
SIDE_VENV = REPO / ".venv-sagemaker"
SIDE_PYTHON = SIDE_VENV / "bin" / "python"
START_TIMEOUT_S = 120.0

#: The user's inference.py: SageMaker's four functions over a tiny linear model whose weights
#: are model.pth. The answer says which process and how big a batch computed it.
INFERENCE_PY = '''\
import io
import json
import os
import time

import numpy as np
import torch


def model_fn(model_dir):
    model = torch.nn.Linear(4, 2)
    model.load_state_dict(torch.load(os.path.join(model_dir, "model.pth")))
    return model.eval()


def input_fn(body, content_type):
    if content_type == "application/json":
        document = json.loads(body)
        if isinstance(document, dict):  # {"x": rows, "sleep_s": seconds}
            time.sleep(float(document.get("sleep_s", 0)))
            document = document["x"]
        return torch.tensor(document, dtype=torch.float32)
    if content_type == "application/x-npy":
        return torch.from_numpy(np.load(io.BytesIO(body), allow_pickle=False))
    raise ValueError("unsupported content type " + repr(content_type))


def predict_fn(data, model):
    with torch.no_grad():
        return model(data), 1


def output_fn(prediction, accept):
    values, batch = prediction
    if accept == "application/x-npy":
        buffer = io.BytesIO()
        np.save(buffer, values.numpy())
        return buffer.getvalue(), accept
    return json.dumps({"y": values.tolist(), "batch": batch, "pid": os.getpid()})
'''

#: batchserve's opt-in to whole batches (backend/service/sagemaker.py).
BATCH_PREDICT_FN = '''

def batch_predict_fn(inputs, model):
    with torch.no_grad():
        outputs = model(torch.cat(inputs))
    return [(part, len(inputs)) for part in torch.split(outputs, [len(x) for x in inputs])]
'''

#: The toolkit's ``serve`` console script, with only its config file's path moved.
SERVE = '''\
import sys

import sagemaker_pytorch_serving_container.torchserve as torchserve

torchserve.TS_CONFIG_FILE = sys.argv[1]

from sagemaker_pytorch_serving_container.serving import main

sys.exit(main())
'''


def side_venv() -> Path:
    """The toolkit's venv, with batchserve joined to it; skip where it could not be made."""
    if not SIDE_PYTHON.exists() or not list(SIDE_VENV.glob(".install-stamp-*")):
        pytest.skip("the SageMaker toolkit's venv (.venv-sagemaker) is missing: `make test` "
                    "creates it with pip (sagemaker-pytorch-inference==2.0.25); it could not "
                    "be installed here")
    purelib = sysconfig.get_paths()["purelib"]
    site_packages = next((SIDE_VENV / "lib").glob("python3*/site-packages"))
    # Our environment after the toolkit's own packages: site.addsitedir also runs its .pth
    # files (the editable install of this checkout).
    (site_packages / "zz_batchserve.pth").write_text(
        f"import site; site.addsitedir({purelib!r})\n")
    entry = SIDE_VENV / "bin" / "torchserve"
    entry.write_text(f"#!{SIDE_PYTHON}\nimport sys\n\nfrom frontend.cli import main\n\n"
                     "sys.exit(main())\n")
    entry.chmod(0o755)
    return SIDE_VENV


@functools.cache
def pid_namespace() -> tuple[str, ...]:
    """``unshare`` into a PID namespace of its own, as a container is, where this machine
    allows it: the toolkit looks for the server among all processes it can see and refuses
    to go on when it sees two (another TorchServe or batchserve on the machine); else none."""
    command = ("unshare", "--pid", "--fork", "--mount-proc")
    if shutil.which("unshare") is None:
        return ()
    probe = subprocess.run([*command, "true"], capture_output=True, timeout=30, check=False)
    return command if probe.returncode == 0 else ()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def weights(path: Path, seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    torch.save(model.state_dict(), path)
    return model.eval()


def model_dir(root: Path, seed: int, batched: bool) -> torch.nn.Linear:
    """A SageMaker model folder: model.pth and code/inference.py."""
    (root / "code").mkdir(parents=True)
    (root / "code" / "inference.py").write_text(INFERENCE_PY + (BATCH_PREDICT_FN if batched
                                                                else ""))
    return weights(root / "model.pth", seed)


def expected(model: torch.nn.Linear, rows: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(rows)).numpy()


def npy(rows: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, rows)
    return buffer.getvalue()


@dataclass
class Container:
    """The toolkit's ``serve`` running batchserve, and where it answers."""

    serve: subprocess.Popen[bytes]
    url: str
    work: Path
    env: dict[str, str]
    isolated: bool

    def post(self, path: str, body: bytes, content_type: str = "application/json",
             accept: str = "application/json", **kwargs: Any) -> requests.Response:
        return requests.post(f"{self.url}{path}", data=body, timeout=60,
                             headers={"Content-Type": content_type, "Accept": accept}, **kwargs)

    def output(self) -> str:
        """What ``serve`` and the server printed (the toolkit's log4j2 file puts the server's
        log on the container's stdout, as TorchServe's), and the model log."""
        model_log = self.work / "logs" / "model_log.log"
        text = model_log.read_text(errors="replace") if model_log.exists() else ""
        return (self.work / "serve.out").read_text(errors="replace")[-5000:] + text[-3000:]

    def wait_for(self, predicate: Callable[[], bool], what: str,
                 timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if self.serve.poll() is not None:
                raise AssertionError(f"serve exited ({self.serve.returncode}) before {what}:\n"
                                     f"{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.output()}")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 90) -> int:
        """SIGTERM to ``serve``, as SageMaker stops a container; its exit code. (In a PID
        namespace of its own, ``serve`` is the child of ``unshare``.) Whatever is left of
        the server afterwards (none should be) is stopped with ``torchserve --stop``."""
        if self.serve.poll() is None:
            target = self.serve.pid
            if self.isolated:
                try:
                    children = psutil.Process(self.serve.pid).children()
                except psutil.NoSuchProcess:
                    children = []
                target = children[0].pid if children else target
            os.kill(target, signal.SIGTERM)
        try:
            return self.serve.wait(timeout=timeout_s)
        finally:
            if self.serve.poll() is None:
                self.serve.kill()
                self.serve.wait(timeout=30)
            subprocess.run([str(SIDE_VENV / "bin" / "torchserve"), "--stop"], env=self.env,
                           cwd=self.work, capture_output=True, timeout=240, check=False)


def start_serve(work: Path, base_dir: Path, entrypoint: Path | None = None,
                **environ: str) -> Container:
    """``serve`` as the toolkit's venv runs it; with ``entrypoint``, through that script run
    as ``ENTRYPOINT serve`` (the SageMaker image's), with a ``serve`` first on its PATH that
    runs ours."""
    venv = side_venv()
    work.mkdir(parents=True, exist_ok=True)
    (work / "serve.py").write_text(SERVE)
    command = [str(venv / "bin" / "python"), str(work / "serve.py"),
               str(work / "sagemaker-ts.properties")]
    path = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    if entrypoint is not None:
        (work / "bin").mkdir(exist_ok=True)
        (work / "bin" / "serve").write_text(f"#!/bin/sh\nexec {shlex.join(command)}\n")
        (work / "bin" / "serve").chmod(0o755)
        command, path = [str(entrypoint), "serve"], f"{work / 'bin'}{os.pathsep}{path}"
    port = free_port()
    env = {**os.environ, "PATH": path,
           "SAGEMAKER_BASE_DIR": str(base_dir), "SAGEMAKER_BIND_TO_PORT": str(port),
           # Ports the toolkit leaves to TorchServe's defaults, moved (its config reads TS_*).
           "TS_GRPC_INFERENCE_PORT": "0", "TS_GRPC_MANAGEMENT_PORT": "0",
           "TS_METRICS_ADDRESS": "http://127.0.0.1:0",
           # This server's own state file, apart from any other batchserve on the machine.
           "BATCHSERVE_STATE_DIR": str(work / "state"), **environ}
    env.pop("BATCHSERVE_FOREGROUND", None)
    env.pop("PYTHONPATH", None)
    prefix = pid_namespace()
    with (work / "serve.out").open("wb") as out:
        serve = subprocess.Popen([*prefix, *command], cwd=work, env=env, stdout=out,
                                 stderr=subprocess.STDOUT)
    container = Container(serve, f"http://127.0.0.1:{port}", work, env, bool(prefix))

    def pinged() -> bool:
        try:
            return requests.get(f"{container.url}/ping", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    try:
        container.wait_for(pinged, "/ping to answer 200")
    except BaseException:
        container.stop()
        raise
    return container


# ---- single model -------------------------------------------------------------------------


@dataclass
class Single:
    container: Container
    model: torch.nn.Linear


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Single]:
    root = tmp_path_factory.mktemp("sagemaker")
    model = model_dir(root / "ml" / "model", seed=1, batched=True)
    container = start_serve(root / "work", root / "ml", SAGEMAKER_TS_BATCH_SIZE="4",
                            SAGEMAKER_TS_MAX_BATCH_DELAY="300", SAGEMAKER_TS_RESPONSE_TIMEOUT="45")
    try:
        yield Single(container, model)
    finally:
        container.stop()


def test_the_toolkit_finds_the_server_and_its_config_reads_as_it_meant(single: Single) -> None:
    config = (single.container.work / "sagemaker-ts.properties").read_text()
    # The toolkit's own file, as it writes it: a line glued to the next.
    assert "enable_model_api=truedefault_response_timeout=60" in config
    description = requests.get(f"{single.container.url}/models/model", timeout=30).json()[0]
    assert description["batchSize"] == 4
    assert description["maxBatchDelay"] == 300
    assert description["responseTimeout"] == 45
    assert description["loadedAtStartup"] is True
    assert description["handler"].endswith("handler_service.py:handle")
    output = single.container.output()
    assert "reads as two lines" in output
    # The toolkit's log4j2 file is applied: the server's log on stdout and in ts_log.log.
    assert "Model server started." in output
    assert "reads as two lines" in (single.container.work / "logs" / "ts_log.log").read_text()
    # TorchServe's management API was on (enable_model_api=true), on the same port.
    assert requests.get(f"{single.container.url}/models", timeout=30).status_code == 200


def test_invocations_answer_json_and_npy(single: Single) -> None:
    rows = np.array([[1, 2, 3, 4], [0.5, -1, 0, 2]], dtype=np.float32)
    want = expected(single.model, rows)
    answer = single.container.post("/invocations", json.dumps(rows.tolist()).encode())
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert np.allclose(answer.json()["y"], want, atol=1e-5)
    answer = single.container.post("/invocations", npy(rows), content_type="application/x-npy",
                                   accept="application/x-npy")
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/x-npy"
    assert np.allclose(np.load(io.BytesIO(answer.content)), want, atol=1e-5)
    # The model by name, as SageMaker's multi-model endpoints and TorchServe allow.
    named = single.container.post("/invocations?model_name=model", npy(rows),
                                  content_type="application/x-npy")
    assert named.status_code == 200 and np.allclose(named.json()["y"], want, atol=1e-5)
    # The user's input_fn refuses a content type: the toolkit's error answer, the server up.
    refused = single.container.post("/invocations", b"1,2,3,4", content_type="text/csv")
    assert refused.status_code == 500 and "unsupported content type" in refused.text


def test_batches_form_and_never_mix_their_requests(single: Single) -> None:
    """Concurrent requests of both content types and both answer types reach
    batch_predict_fn together; each answer is its own request's, in its own type."""
    def ask(i: int) -> tuple[int, requests.Response]:
        rows = np.full((1 + i % 2, 4), float(i), dtype=np.float32)
        body, content_type = ((npy(rows), "application/x-npy") if i % 2
                              else (json.dumps(rows.tolist()).encode(), "application/json"))
        accept = "application/x-npy" if i % 3 == 0 else "application/json"
        return i, single.container.post("/invocations", body, content_type=content_type,
                                        accept=accept)

    biggest = 0
    deadline = time.monotonic() + 60
    with ThreadPoolExecutor(8) as pool:
        for _round in range(10):
            for i, answer in pool.map(ask, range(8)):
                assert answer.status_code == 200, answer.text
                want = expected(single.model, np.full((1 + i % 2, 4), float(i), np.float32))
                if i % 3 == 0:
                    assert answer.headers["content-type"] == "application/x-npy"
                    got = np.load(io.BytesIO(answer.content))
                else:
                    assert answer.headers["content-type"] == "application/json"
                    got = np.array(answer.json()["y"])
                    biggest = max(biggest, answer.json()["batch"])
                assert np.allclose(got, want, atol=1e-5), i
            if biggest > 1 or time.monotonic() > deadline:
                break
    assert biggest > 1, "no batch of more than one request reached batch_predict_fn"


def test_sigterm_to_serve_drains_and_exits_0(single: Single) -> None:
    """Last in this module: SageMaker stops the container with SIGTERM to ``serve``, which
    forwards it to the server; an answer in flight still comes, then everything exits 0."""
    container = single.container
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(container.post, "/invocations",
                           json.dumps({"x": [[1, 2, 3, 4]], "sleep_s": 2}).encode())
        container.wait_for(lambda: _in_flight(container) > 0, "the slow request to reach the "
                           "worker", timeout_s=30)
        assert container.stop() == 0
        assert slow.result(timeout=60).status_code == 200


def _in_flight(container: Container) -> int:
    description = requests.get(f"{container.url}/models/model", timeout=30).json()[0]
    return int(description["batching"]["inFlightBatches"])


# ---- multi-model --------------------------------------------------------------------------


def test_multi_model_endpoint_loads_invokes_and_unloads_two_models(tmp_path: Path) -> None:
    models = tmp_path / "ml" / "models"
    plain = model_dir(models / "plain" / "model", seed=2, batched=False)
    batched = model_dir(models / "batched" / "model", seed=3, batched=True)
    container = start_serve(tmp_path / "work", tmp_path / "ml", SAGEMAKER_MULTI_MODEL="true")
    try:
        url = container.url
        assert requests.get(f"{url}/models", timeout=30).json()["models"] == []
        for name in ("plain", "batched"):
            # As SageMaker's agent registers a model of a multi-model endpoint: a JSON body.
            answer = requests.post(f"{url}/models", timeout=120, json={
                "url": str(models / name / "model"), "model_name": name,
                "initial_workers": 1, "batch_size": 4, "max_batch_delay": 300})
            assert answer.status_code == 200, answer.text
        listed = {m["modelName"] for m in requests.get(f"{url}/models", timeout=30).json()
                  ["models"]}
        assert listed == {"plain", "batched"}
        rows = np.array([[1, 0, 0, 1]], dtype=np.float32)
        for name, model in (("plain", plain), ("batched", batched)):
            answer = container.post(f"/models/{name}/invoke", npy(rows),
                                    content_type="application/x-npy")
            assert answer.status_code == 200, answer.text
            assert np.allclose(answer.json()["y"], expected(model, rows), atol=1e-5)

        # The toolkit's own handle, per request, in batches of mixed content types.
        def ask(i: int) -> tuple[int, requests.Response]:
            rows = np.full((1, 4), float(i), dtype=np.float32)
            if i % 2:
                return i, container.post("/models/plain/invoke", npy(rows),
                                         content_type="application/x-npy",
                                         accept="application/x-npy")
            return i, container.post("/models/plain/invoke", json.dumps(rows.tolist()).encode())

        with ThreadPoolExecutor(8) as pool:
            for i, answer in pool.map(ask, range(16)):
                assert answer.status_code == 200, (i, answer.text)
                want = expected(plain, np.full((1, 4), float(i), np.float32))
                got = (np.load(io.BytesIO(answer.content)) if i % 2
                       else np.array(answer.json()["y"]))
                assert answer.headers["content-type"] == ("application/x-npy" if i % 2
                                                          else "application/json")
                assert np.allclose(got, want, atol=1e-5), i
        for name in ("plain", "batched"):
            assert requests.delete(f"{url}/models/{name}", timeout=120).status_code == 200
        assert requests.get(f"{url}/models", timeout=30).json()["models"] == []
        assert container.post("/models/plain/invoke", npy(rows)).status_code == 404
    finally:
        code = container.stop()
    assert code == 0, container.output()

