"""The SageMaker image's smoke test: the image run as SageMaker runs it (``make image
IMAGE_ARGS="--variant sagemaker"``, or ``python -m docker.build --variant sagemaker
--smoke-only`` on a built image).

SageMaker starts a hosting container as ``docker run IMAGE serve`` with the model data mounted,
and speaks HTTP to its port 8080. Each run here is that: ``podman run ... IMAGE serve`` in its
own network namespace (podman's bridge), 8080 published on a free port of 127.0.0.1 only (the
toolkit binds 0.0.0.0, as SageMaker needs, so nothing else is exposed).

The checks are docker/sagemaker_contract.py's, which ``make test`` also runs against the
toolkit outside any container; here they reach into the container with ``podman exec``:

1. **single model**: a model directory as SageMaker unpacks ``model.tar.gz`` (``model.pth``, a
   torch ``Linear(4, 4)`` state_dict; ``code/inference.py``, docker/smoke_inference.py, with
   ``model_fn``/``input_fn``/``predict_fn``/``output_fn``) mounted read-only at /opt/ml/model.
   PID 1 is the toolkit's ``serve``, every process runs as uid 1000.
2. **multi-model** (``SAGEMAKER_MULTI_MODEL=true``): two model directories with other weights
   under /opt/ml/models/<name>/model.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from docker.build import WORK, BuildError, container_processes, podman, ulimits, wait_until
from docker.contract import STOP_GRACE_S, Check, run_checks
from docker.sagemaker_contract import (
    MULTI,
    SERVING_PORT,
    SINGLE,
    Toolkit,
    call,
    given,
    multi_model_checks,
    single_model_checks,
)

CONTAINER = "batchserve-sagemaker-smoke"
UID = 1000  # the image's USER


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
    text = f"== podman logs\n{output()}"
    # `torchserve --start` sends the server's own output to logs/ in its working directory;
    # podman cp reads it from a stopped container too.
    with tempfile.TemporaryDirectory() as copy:
        subprocess.run(["podman", "cp", f"{CONTAINER}:/home/model-server/logs", copy],
                       capture_output=True)
        for path in sorted(Path(copy).rglob("*.log")):
            text += f"\n== {path.name}\n{path.read_text(errors='replace')}"
    (WORK / f"sagemaker-{phase}.log").write_text(text)


def stop() -> int:
    """``podman stop``: SIGTERM to PID 1 (the toolkit), which forwards it to the server; the
    container's exit status (a SIGKILL after the grace would be 137)."""
    if not any(p.pid == 1 for p in container_processes(CONTAINER)):
        return -1  # the container had ended before SIGTERM
    podman("stop", "--time", str(STOP_GRACE_S), CONTAINER, timeout=STOP_GRACE_S + 60)
    return int(podman("inspect", "--format", "{{.State.ExitCode}}", CONTAINER).strip())


def output() -> str:
    logs = subprocess.run(["podman", "logs", CONTAINER], capture_output=True, text=True)
    return logs.stdout + logs.stderr


def in_container(base: str, env: Sequence[str]) -> Toolkit:
    """The contract's view of the running container: PID 1 is ``serve``, as uid 1000."""
    return Toolkit(
        base=base, env=given(env), cpus=int(podman("exec", CONTAINER, "nproc").strip()),
        config=lambda: podman("exec", CONTAINER, "cat", "/etc/sagemaker-ts.properties"),
        processes=lambda: container_processes(CONTAINER), serve=1, serve_program="serve",
        environ=lambda: podman("exec", CONTAINER, "sh", "-c",
                               "tr '\\0' '\\n' < /proc/1/environ"),
        uid=UID, alone=True, output=output,
        ts_log=lambda: podman("exec", CONTAINER, "cat", "logs/ts_log.log"), stop=stop)


def single_model(base: str, env: Sequence[str]) -> list[tuple[str, Check]]:
    return single_model_checks(in_container(base, env))


def multi_model(base: str, env: Sequence[str]) -> list[tuple[str, Check]]:
    return multi_model_checks(in_container(base, env),
                              lambda name: f"/opt/ml/models/{name}/model")


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
             single_model),
            ("multi-model", {layout / "models": "/opt/ml/models"},
             ["SAGEMAKER_MULTI_MODEL=true", *env], multi_model)]
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
