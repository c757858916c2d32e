"""The SageMaker image's smoke test: the image run as SageMaker runs it (``make image
IMAGE_ARGS="--variant sagemaker"``, or ``python -m docker.build --variant sagemaker
--smoke-only`` on a built image).

SageMaker starts a hosting container as ``docker run IMAGE serve`` with the model data mounted,
and speaks HTTP to its port 8080. Each run here is that: ``podman run ... IMAGE serve`` in its
own network namespace (podman's bridge), 8080 published on a free port of 127.0.0.1 only (the
toolkit binds 0.0.0.0, as SageMaker needs, so nothing else is exposed).

1. **single model**: a model directory as SageMaker unpacks ``model.tar.gz`` (``model.pth``, a
   torch ``Linear(4, 4)`` state_dict; ``code/inference.py``, docker/smoke_inference.py, with
   ``model_fn``/``input_fn``/``predict_fn``/``output_fn``) mounted read-only at /opt/ml/model.
   ``GET /ping``; ``POST /invocations`` with a JSON and an NPY body; the toolkit wrote
   /etc/sagemaker-ts.properties; the server's log is on the container's output, as the
   toolkit's log4j2 file says; PID 1 is the toolkit's ``serve`` and it found exactly one
   server process by its marker; no process runs as root; the model has the entry point's
   worker count (or the batch settings and workers that ``--env`` gives); SIGTERM ends it
   with status 0.
2. **multi-model** (``SAGEMAKER_MULTI_MODEL=true``): two model directories with other weights
   under /opt/ml/models/<name>/model. Each is registered as SageMaker's agent does (``POST
   /models``, JSON body ``{"model_name", "url"}``), listed, invoked at
   ``/models/<name>/invoke``; registering one again is 409; one is unregistered with
   ``DELETE /models/<name>``, after which it is 404 and the other still answers; SIGTERM ends
   it with status 0.
"""

from __future__ import annotations

import io
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from docker.build import (
    STOP_GRACE_S,
    WORK,
    BuildError,
    container_processes,
    podman,
    ulimits,
    wait_until,
)

CONTAINER = "batchserve-sagemaker-smoke"
USER_SCRIPT = Path(__file__).resolve().parent / "smoke_inference.py"
SERVING_PORT = 8080  # SageMaker's; the toolkit's default for SAGEMAKER_BIND_TO_PORT
# How the toolkit finds the server among the processes (its torchserve.TS_NAMESPACE).
SERVER_MARKER = "org.pytorch.serve.ModelServer"

INPUTS = [[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]]


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

Check = Callable[[], tuple[bool, str]]


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def readable(root: Path) -> None:
    """Everything under root readable by the image's uid 1000 (a temporary folder is 0700)."""
    for path in (root, *root.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)


# ---- one container ---------------------------------------------------------------------

@contextmanager
def container(tag: str, mounts: dict[Path, str], env: Sequence[str], phase: str,
              start_timeout_s: float) -> Iterator[str]:
    """``podman run IMAGE serve`` with the mounts (read-only) and env, until /ping answers;
    yields its base URL. Its log, with the server's own log file, is kept in
    build/image/sagemaker-<phase>.log."""
    subprocess.run(["podman", "rm", "--force", CONTAINER], capture_output=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    try:
        podman("run", "--detach", "--name", CONTAINER, *ulimits(),
               "--publish", f"127.0.0.1:{port}:{SERVING_PORT}",
               *(flag for path, target in mounts.items()
                 for flag in ("--volume", f"{path}:{target}:ro")),
               *(flag for pair in env for flag in ("--env", pair)),
               tag, "serve")
        print(f"   {phase}: started `serve` ({' '.join(env) or 'no env'}), 8080 on {base}",
              flush=True)
        wait_until(lambda: call("GET", f"{base}/ping", timeout=5).status == 200,
                   start_timeout_s, f"{base}/ping answering 200", container=CONTAINER)
        yield base
    finally:
        keep_logs(phase)
        subprocess.run(["podman", "rm", "--force", CONTAINER], capture_output=True)


def keep_logs(phase: str) -> None:
    logs = subprocess.run(["podman", "logs", CONTAINER], capture_output=True, text=True)
    text = f"== podman logs\n{logs.stdout}{logs.stderr}"
    # `torchserve --start` sends the server's own output to logs/ in its working directory;
    # podman cp reads it from a stopped container too.
    with tempfile.TemporaryDirectory() as copy:
        subprocess.run(["podman", "cp", f"{CONTAINER}:/home/model-server/logs", copy],
                       capture_output=True)
        for path in sorted(Path(copy).rglob("*.log")):
            text += f"\n== {path.name}\n{path.read_text(errors='replace')}"
    (WORK / f"sagemaker-{phase}.log").write_text(text)


def run_checks(checks: Sequence[tuple[str, Check]]) -> tuple[int, int]:
    passed = failed = 0
    for name, check in checks:
        try:
            ok, detail = check()
        except Exception as exc:  # a check that cannot even ask has failed, and says so
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        passed, failed = passed + ok, failed + (not ok)
        print(f"   {'PASS' if ok else 'FAIL'} {name}: {detail[:300]}", flush=True)
    return passed, failed


def sigterm_exits_0() -> tuple[bool, str]:
    """``podman stop`` sends SIGTERM to PID 1 (the toolkit), which forwards it to the server:
    the server drains, the toolkit's wait ends, the container exits 0 before the grace runs
    out (a SIGKILL would be 137)."""
    if not any(p[0] == "1" for p in container_processes(CONTAINER)):
        return False, "no PID 1: the container had ended before SIGTERM"
    start = time.monotonic()
    podman("stop", "--time", str(STOP_GRACE_S), CONTAINER, timeout=STOP_GRACE_S + 60)
    stop_s = time.monotonic() - start
    code = podman("inspect", "--format", "{{.State.ExitCode}}", CONTAINER).strip()
    return code == "0" and stop_s < STOP_GRACE_S, f"status {code} in {stop_s:.1f} s"


# ---- 1. single model -------------------------------------------------------------------

def single_model_checks(base: str, env: Sequence[str]) -> list[tuple[str, Check]]:
    expected = SINGLE.expected()

    def ping() -> tuple[bool, str]:
        answer = call("GET", f"{base}/ping")
        return answer.status == 200, str(answer)

    def invocations(encode: Callable[[Any], tuple[bytes, dict[str, str]]]) -> Check:
        def check() -> tuple[bool, str]:
            body, headers = encode(INPUTS)
            answer = call("POST", f"{base}/invocations", body, headers)
            ok = (answer.status == 200 and answer.json() == expected
                  and answer.content_type.startswith("application/json"))
            return ok, str(answer)
        return check

    def config_written() -> tuple[bool, str]:
        text = podman("exec", CONTAINER, "cat", "/etc/sagemaker-ts.properties")
        wanted = ["default_service_handler=", "sagemaker_pytorch_serving_container",
                  f"inference_address=http://0.0.0.0:{SERVING_PORT}",
                  f"management_address=http://0.0.0.0:{SERVING_PORT}"]
        missing = [line for line in wanted if line not in text]
        return not missing, f"missing {missing}" if missing else f"{len(text)} bytes"

    def processes() -> tuple[bool, str]:
        listed = container_processes(CONTAINER)
        pid1 = next((p for p in listed if p[0] == "1"), None)
        servers = [p for p in listed if SERVER_MARKER in p[3].split()]
        uids = sorted({p[2] for p in listed})
        environ = podman("exec", CONTAINER, "sh", "-c", "tr '\\0' '\\n' < /proc/1/environ")
        foreground = [line for line in environ.splitlines()
                      if line.startswith("BATCHSERVE_FOREGROUND=")]
        ok = (pid1 is not None and any(arg.endswith("/bin/serve") for arg in pid1[3].split())
              and len(servers) == 1 and "0" not in uids and not foreground)
        return ok, ((f"PID 1: {pid1[3].strip()}; " if pid1 else "no PID 1; ")
                    + f"{len(servers)} with {SERVER_MARKER}; uids {uids}; "
                    + f"{foreground or 'no BATCHSERVE_FOREGROUND'}")

    def settings() -> tuple[bool, str]:
        # The toolkit names its model "model". Its workers: with a SAGEMAKER_TS_* variable,
        # the toolkit's models= entry; else default_workers_per_model, which the entry point
        # makes the container's CPU count unless SAGEMAKER_MODEL_SERVER_WORKERS is given.
        given = dict(pair.split("=", 1) for pair in env)
        cpus = int(podman("exec", CONTAINER, "nproc").strip())
        if any(key.startswith("SAGEMAKER_TS_") for key in given):
            wanted = {"minWorkers": int(given.get("SAGEMAKER_TS_MIN_WORKERS", 1)),
                      "batchSize": int(given.get("SAGEMAKER_TS_BATCH_SIZE", 1)),
                      "maxBatchDelay": int(given.get("SAGEMAKER_TS_MAX_BATCH_DELAY", 100))}
        else:
            wanted = {"minWorkers": int(given.get("SAGEMAKER_MODEL_SERVER_WORKERS", cpus)),
                      "batchSize": 1}
        answer = call("GET", f"{base}/models/model")
        described = answer.json()
        found = (described[0] if isinstance(described, list) and described
                 and isinstance(described[0], dict) else {})
        got = {key: found.get(key) for key in wanted}
        return answer.status == 200 and got == wanted, f"nproc {cpus}; wanted {wanted}, " \
            f"got {got}"

    def server_log_on_output() -> tuple[bool, str]:
        # The toolkit's log4j2 file sends the server's log to the console, which SageMaker
        # sends to CloudWatch: the workers' start is there, and in logs/ts_log.log.
        wanted = "W-9000-model_1.0 loaded the model in"
        output = subprocess.run(["podman", "logs", CONTAINER], capture_output=True, text=True)
        ts_log = podman("exec", CONTAINER, "cat", "logs/ts_log.log")
        where = [name for name, text in (("output", output.stdout + output.stderr),
                                         ("logs/ts_log.log", ts_log)) if wanted in text]
        return where == ["output", "logs/ts_log.log"], f"{wanted!r} in {where}"

    return [("GET /ping", ping),
            ("POST /invocations, JSON", invocations(json_body)),
            ("POST /invocations, NPY", invocations(npy_body)),
            ("the toolkit wrote /etc/sagemaker-ts.properties", config_written),
            ("the server's log: on the container's output and in logs/ts_log.log",
             server_log_on_output),
            ("PID 1 is the toolkit's serve; one server, found by its marker; no root; "
             "no BATCHSERVE_FOREGROUND", processes),
            ("the model's workers: the CPU count, or as the env says", settings),
            ("SIGTERM: the toolkit forwards it, exit 0", sigterm_exits_0)]


# ---- 2. multi-model --------------------------------------------------------------------

def multi_model_checks(base: str, env: Sequence[str]) -> list[tuple[str, Check]]:
    def model_url(name: str) -> str:
        return f"/opt/ml/models/{name}/model"

    def register(name: str, status: int) -> Check:
        def check() -> tuple[bool, str]:
            # As SageMaker's agent loads a model (its multi-model container contract).
            body, headers = json_body({"model_name": name, "url": model_url(name)})
            answer = call("POST", f"{base}/models", body, headers, timeout=300)
            return answer.status == status, str(answer)
        return check

    def listed() -> tuple[bool, str]:
        answer = call("GET", f"{base}/models")
        models = (answer.json() or {}).get("models", [])
        found = {m.get("modelName"): m.get("modelUrl") for m in models}
        return found == {name: model_url(name) for name in MULTI}, str(answer)

    def invoke(name: str, expected: list[list[float]] | None) -> Check:
        def check() -> tuple[bool, str]:
            body, headers = json_body(INPUTS)
            headers["X-Amzn-SageMaker-Target-Model"] = f"{name}.tar.gz"
            answer = call("POST", f"{base}/models/{name}/invoke", body, headers)
            if expected is None:
                return answer.status == 404, str(answer)
            return answer.status == 200 and answer.json() == expected, str(answer)
        return check

    def unregister(name: str) -> Check:
        def check() -> tuple[bool, str]:
            answer = call("DELETE", f"{base}/models/{name}", timeout=120)
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
            ("SIGTERM: the toolkit forwards it, exit 0", sigterm_exits_0)]


# ---- both --------------------------------------------------------------------------------

def smoke(tag: str, start_timeout_s: float, env: Sequence[str] = ()) -> tuple[int, int]:
    """Both runs, one after the other, each with ``env`` added (KEY=VALUE): (passed,
    failed)."""
    layout = Path(tempfile.mkdtemp(prefix="batchserve-sagemaker-smoke-"))
    passed = failed = 0
    try:
        SINGLE.write(layout / "model")
        for name, weights in MULTI.items():
            weights.write(layout / "models" / name / "model")
        readable(layout)
        runs: list[tuple[str, dict[Path, str], list[str],
                         Callable[[str, Sequence[str]], list[tuple[str, Check]]]]] = [
            ("single-model", {layout / "model": "/opt/ml/model"}, [*env],
             single_model_checks),
            ("multi-model", {layout / "models": "/opt/ml/models"},
             ["SAGEMAKER_MULTI_MODEL=true", *env], multi_model_checks)]
        for phase, mounts, env, checks in runs:
            try:
                with container(tag, mounts, env, phase, start_timeout_s) as base:
                    done = run_checks(checks(base, env))
            except BuildError as exc:  # it did not start: that run's checks all fail
                print(f"   FAIL {phase}: {exc}", flush=True)
                done = (0, 1)
            passed, failed = passed + done[0], failed + done[1]
            print(f"   ({phase}: the container's log is in "
                  f"{WORK / f'sagemaker-{phase}.log'})", flush=True)
    finally:
        shutil.rmtree(layout, ignore_errors=True)
    return passed, failed
