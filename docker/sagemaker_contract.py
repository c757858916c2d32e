"""What the SageMaker image promises, as checks that run two ways (docker/contract.py says why):
docker/sagemaker_smoke.py runs them against the image as SageMaker runs it, ``make test``
against the SageMaker toolkit's ``serve`` started outside any container with the image's
entry point and environment (tests/integration/test_image_contract.py).

1. **single model** (SageMaker's ``model.tar.gz`` unpacked at /opt/ml/model): ``GET /ping``;
   ``POST /invocations`` with a JSON and an NPY body; the toolkit wrote its config; the
   server's log in TorchServe's layout in logs/ts_log.log and on the console; the toolkit's
   ``serve`` is the root of the processes, it found exactly one server by its marker, the
   workers are the server's, nothing runs as another uid, ``BATCHSERVE_FOREGROUND`` is unset;
   describe shows the workers and batch settings the environment asked for; SIGTERM to
   ``serve`` ends it with status 0.
2. **multi-model** (``SAGEMAKER_MULTI_MODEL=true``): two models registered as SageMaker's
   agent registers them, listed, invoked, 409 again, unregistered (then 404, the other still
   answering); SIGTERM ends it with status 0.
"""

from __future__ import annotations

import io
import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from docker.contract import (
    INPUTS,
    Check,
    Process,
    described_workers,
    runs,
    server_and_workers,
    server_log,
    sigterm_exits_0,
    subtree,
)

USER_SCRIPT = Path(__file__).resolve().parent / "smoke_inference.py"
SERVING_PORT = 8080  # SageMaker's; the toolkit's default for SAGEMAKER_BIND_TO_PORT
# How the toolkit finds the server among the processes (its torchserve.TS_NAMESPACE).
SERVER_MARKER = "org.pytorch.serve.ModelServer"
#: The toolkit's name for the single model.
MODEL = "model"


@dataclass(frozen=True)
class Affine:
    """A model's weights: ``y = scale * x + shift`` on each of 4 numbers."""

    scale: float
    shift: float

    def expected(self) -> list[list[float]]:
        return [[self.scale * x + self.shift for x in row] for row in INPUTS]

    def write(self, model_dir: Path) -> None:
        """A model directory as SageMaker unpacks one: the weights, code/inference.py."""
        (model_dir / "code").mkdir(parents=True)
        model = torch.nn.Linear(4, 4)
        with torch.no_grad():
            model.weight.copy_(self.scale * torch.eye(4))
            model.bias.fill_(self.shift)
        torch.save(model.state_dict(), model_dir / "model.pth")
        shutil.copyfile(USER_SCRIPT, model_dir / "code" / "inference.py")


SINGLE = Affine(scale=2.0, shift=1.0)
MULTI = {"alpha": Affine(scale=2.0, shift=1.0), "beta": Affine(scale=3.0, shift=-1.0)}


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: bytes

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    def __str__(self) -> str:
        return f"{self.status} {self.content_type or '-'} {self.body[:200]!r}"


def call(method: str, url: str, body: bytes | None = None,
         headers: dict[str, str] | None = None, timeout: float = 60) -> Answer:
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return Answer(response.status, response.headers.get("Content-Type", ""),
                          response.read())
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.headers.get("Content-Type", ""), exc.read())


def json_body(value: Any) -> tuple[bytes, dict[str, str]]:
    return json.dumps(value).encode(), {"Content-Type": "application/json",
                                        "Accept": "application/json"}


def npy_body(value: Any) -> tuple[bytes, dict[str, str]]:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(value, dtype=np.float32), allow_pickle=False)
    return buffer.getvalue(), {"Content-Type": "application/x-npy",
                               "Accept": "application/json"}


@dataclass(frozen=True)
class Toolkit:
    """A server the toolkit's ``serve`` started, and how the checks reach it: a container
    (docker/sagemaker_smoke.py) or processes on this machine (the test)."""

    base: str
    """The URL of SageMaker's port (8080 in the container)."""
    env: Mapping[str, str]
    """The variables the run was given, beyond the image's."""
    cpus: int
    """What ``nproc`` says where the entry point ran."""
    config: Callable[[], str]
    """The config file the toolkit wrote (/etc/sagemaker-ts.properties)."""
    processes: Callable[[], list[Process]]
    serve: int
    """The PID of the toolkit's ``serve`` (1 in the container)."""
    serve_program: str
    """What ``serve`` runs (the console script ``serve``; a stand-in for it outside)."""
    environ: Callable[[], str]
    """``serve``'s environment, one variable a line."""
    uid: int
    """Every process's uid (1000 in the image)."""
    alone: bool
    """The processes are the container's: none but the toolkit's."""
    output: Callable[[], str]
    """The console: the container's log."""
    ts_log: Callable[[], str]
    """logs/ts_log.log in ``serve``'s working directory."""
    stop: Callable[[], int]
    """SIGTERM to ``serve``; its exit status."""


def single_model_checks(at: Toolkit) -> list[tuple[str, Check]]:
    expected = SINGLE.expected()

    def ping() -> tuple[bool, str]:
        answer = call("GET", f"{at.base}/ping")
        return answer.status == 200, str(answer)

    def invocations(encode: Callable[[Any], tuple[bytes, dict[str, str]]]) -> Check:
        def check() -> tuple[bool, str]:
            body, headers = encode(INPUTS)
            answer = call("POST", f"{at.base}/invocations", body, headers)
            ok = (answer.status == 200 and answer.json() == expected
                  and answer.content_type.startswith("application/json"))
            return ok, str(answer)
        return check

    def config_written() -> tuple[bool, str]:
        text = at.config()
        port = at.env.get("SAGEMAKER_BIND_TO_PORT", SERVING_PORT)
        wanted = ["default_service_handler=", "sagemaker_pytorch_serving_container",
                  f"inference_address=http://0.0.0.0:{port}",
                  f"management_address=http://0.0.0.0:{port}"]
        missing = [line for line in wanted if line not in text]
        return not missing, f"missing {missing}" if missing else f"{len(text)} bytes"

    def processes() -> tuple[bool, str]:
        listed = at.processes()
        tree = subtree(listed, at.serve)
        root = next((p for p in tree if p.pid == at.serve), None)
        servers = [p for p in (listed if at.alone else tree) if SERVER_MARKER in p.command.split()]
        foreground = [line for line in at.environ().splitlines()
                      if line.startswith("BATCHSERVE_FOREGROUND=")]
        ok, workers = False, "no server"
        if len(servers) == 1:
            ok, workers = server_and_workers(
                listed, servers[0].pid, at.uid, described_workers(at.base, MODEL),
                alone=at.alone, marker=SERVER_MARKER)
        ok = (ok and root is not None and runs(root, at.serve_program)
              and servers[0] in tree and {p.uid for p in tree} == {at.uid} and not foreground)
        return ok, ((f"{at.serve}: {root.command.strip()}; " if root else f"no {at.serve}; ")
                    + f"{len(servers)} with {SERVER_MARKER}; {workers}; "
                    + f"{foreground or 'no BATCHSERVE_FOREGROUND'}")

    def settings() -> tuple[bool, str]:
        # The toolkit names its model "model". Its workers: with a SAGEMAKER_TS_* variable,
        # the toolkit's models= entry; else default_workers_per_model, which the entry point
        # makes the container's CPU count unless SAGEMAKER_MODEL_SERVER_WORKERS is given.
        given = at.env
        if any(key.startswith("SAGEMAKER_TS_") for key in given):
            wanted = {"minWorkers": int(given.get("SAGEMAKER_TS_MIN_WORKERS", 1)),
                      "batchSize": int(given.get("SAGEMAKER_TS_BATCH_SIZE", 1)),
                      "maxBatchDelay": int(given.get("SAGEMAKER_TS_MAX_BATCH_DELAY", 100))}
        else:
            wanted = {"minWorkers": int(given.get("SAGEMAKER_MODEL_SERVER_WORKERS", at.cpus)),
                      "batchSize": 1}
        answer = call("GET", f"{at.base}/models/{MODEL}")
        described = answer.json()
        found = (described[0] if isinstance(described, list) and described
                 and isinstance(described[0], dict) else {})
        got = {key: found.get(key) for key in wanted}
        return answer.status == 200 and got == wanted, f"nproc {at.cpus}; wanted {wanted}, " \
            f"got {got}"

    return [("GET /ping", ping),
            ("POST /invocations, JSON", invocations(json_body)),
            ("POST /invocations, NPY", invocations(npy_body)),
            ("the toolkit wrote its config (/etc/sagemaker-ts.properties)", config_written),
            ("the server's log: TorchServe's layout, the worker's lines, in logs/ts_log.log "
             "and on the console", server_log(at.output, at.ts_log, MODEL)),
            ("the toolkit's serve is the root; one server, found by its marker; its workers "
             "its own; one uid; no BATCHSERVE_FOREGROUND", processes),
            ("the model's workers: the CPU count, or as the env says", settings),
            ("SIGTERM: the toolkit forwards it, exit 0", sigterm_exits_0(at.stop))]


def multi_model_checks(at: Toolkit, model_url: Callable[[str], str]
                       ) -> list[tuple[str, Check]]:
    """``model_url``: where SageMaker put a model's directory (/opt/ml/models/<name>/model)."""
    def register(name: str, status: int) -> Check:
        def check() -> tuple[bool, str]:
            # As SageMaker's agent loads a model (its multi-model container contract).
            body, headers = json_body({"model_name": name, "url": model_url(name)})
            answer = call("POST", f"{at.base}/models", body, headers, timeout=300)
            return answer.status == status, str(answer)
        return check

    def listed() -> tuple[bool, str]:
        answer = call("GET", f"{at.base}/models")
        models = (answer.json() or {}).get("models", [])
        found = {m.get("modelName"): m.get("modelUrl") for m in models}
        return found == {name: model_url(name) for name in MULTI}, str(answer)

    def invoke(name: str, expected: list[list[float]] | None) -> Check:
        def check() -> tuple[bool, str]:
            body, headers = json_body(INPUTS)
            headers["X-Amzn-SageMaker-Target-Model"] = f"{name}.tar.gz"
            answer = call("POST", f"{at.base}/models/{name}/invoke", body, headers)
            if expected is None:
                return answer.status == 404, str(answer)
            return answer.status == 200 and answer.json() == expected, str(answer)
        return check

    def unregister(name: str) -> Check:
        def check() -> tuple[bool, str]:
            answer = call("DELETE", f"{at.base}/models/{name}", timeout=120)
            return answer.status == 200, str(answer)
        return check

    first, second = MULTI
    return [*((f"POST /models {name} (JSON body, as SageMaker's agent)", register(name, 200))
              for name in MULTI),
            ("GET /models lists both, with their urls", listed),
            *((f"POST /models/{name}/invoke", invoke(name, MULTI[name].expected()))
              for name in MULTI),
            (f"POST /models {first} again: 409", register(first, 409)),
            (f"DELETE /models/{first}", unregister(first)),
            (f"POST /models/{first}/invoke after DELETE: 404", invoke(first, None)),
            (f"POST /models/{second}/invoke still", invoke(second, MULTI[second].expected())),
            ("SIGTERM: the toolkit forwards it, exit 0", sigterm_exits_0(at.stop))]


def given(env: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` pairs as a mapping."""
    return dict(pair.split("=", 1) for pair in env)
