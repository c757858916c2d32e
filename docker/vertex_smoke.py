"""The Vertex AI image's smoke test: the image run as Vertex AI runs a prediction container
(``make image IMAGE_ARGS="--variant vertex"``, or ``python -m docker.build --variant vertex
--smoke-only`` on a built image).

Vertex starts the image's own command with the ``AIP_*`` environment and sends every request
to ``AIP_HTTP_PORT``. Here: ``podman run IMAGE`` (its CMD, ``torchserve --start
--foreground``, no model arguments) in its own network namespace, with Vertex's variables
(docker/vertex_contract.py's ``aip_env``; ``AIP_HTTP_PORT`` 7080, not the default, so that the
port is seen to follow it) and the model's artifact folder (``model.mar`` built for the
prebuilt image) mounted read-only as ``AIP_STORAGE_URI``; 7080 published on a free port of
127.0.0.1.

Checks: the contract (docker/vertex_contract.py, as ``make test`` checks it on the real
server): health route, predict route with base64 and plain instances, 1.5 MB limit, 400/405;
then PID 1 is the server itself, as uid 1000, its workers its descendants; the image can fetch
``gs://`` (Google's storage library imports); SIGTERM ends it with status 0. No check reads
the wording of a log line (docs/container.md).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from docker.build import UID, WORK, BuildError, container_processes, podman, ulimits, wait_until
from docker.contract import (
    STOP_GRACE_S,
    WORKER_MARK,
    run_checks,
    server_and_workers,
    sigterm_exits_0,
)
from docker.sagemaker_smoke import free_port
from docker.vertex_contract import HEALTH, Check, aip_env, artifact_folder, call
from docker.vertex_contract import contract_checks as vertex_contract_checks

CONTAINER = "batchserve-vertex-smoke"
PORT = 7080
STORAGE = "/mnt/artifacts"


def image_checks() -> list[tuple[str, Check]]:
    def processes() -> tuple[bool, str]:
        # PID 1 is the server (the image's torchserve in the foreground); every worker process
        # (and the fork server they are forked from, also ``-m backend``) descends from it;
        # all run as the image's uid.
        listed = container_processes(CONTAINER)
        workers = [p.pid for p in listed if WORKER_MARK in p.command]
        return server_and_workers(listed, 1, UID, workers, alone=True)

    def storage_library() -> tuple[bool, str]:
        found = subprocess.run(["podman", "exec", CONTAINER, "python3", "-c",
                                "import google.cloud.storage as s; print(s.__version__)"],
                               capture_output=True, text=True)
        return found.returncode == 0, (found.stdout or found.stderr).strip()[-200:]

    return [("PID 1 is the server, as uid 1000; its workers descend from it", processes),
            ("gs:// can be fetched: google.cloud.storage imports", storage_library)]


def stop_container() -> int:
    """SIGTERM (``podman stop``, SIGKILL only after STOP_GRACE_S): the exit status."""
    podman("stop", "--time", str(STOP_GRACE_S), CONTAINER, timeout=STOP_GRACE_S + 60)
    return int(podman("inspect", "--format", "{{.State.ExitCode}}", CONTAINER).strip())


def smoke(tag: str, start_timeout_s: float, env: Sequence[str] = ()) -> tuple[int, int]:
    """One container, Vertex's way, with ``env`` (KEY=VALUE) added: (passed, failed)."""
    subprocess.run(["podman", "rm", "--force", CONTAINER], capture_output=True)
    root = Path(tempfile.mkdtemp(prefix="batchserve-vertex-smoke-"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    try:
        folder = artifact_folder(root)
        variables = [f"{k}={v}" for k, v in aip_env(STORAGE, PORT).items()] + list(env)
        podman("run", "--detach", "--name", CONTAINER, *ulimits(),
               "--publish", f"127.0.0.1:{port}:{PORT}", "--volume", f"{folder}:{STORAGE}:ro",
               *(flag for pair in variables for flag in ("--env", pair)), tag)
        print(f"   started its CMD with AIP_HTTP_PORT={PORT} ({base}), AIP_STORAGE_URI="
              f"{STORAGE}", flush=True)
        try:
            wait_until(lambda: call("GET", base + HEALTH, timeout=5)[0] == 200,
                       start_timeout_s, f"{HEALTH} answering 200", container=CONTAINER)
        except BuildError as exc:
            print(f"   FAIL start: {exc}", flush=True)
            return 0, 1
        passed, failed = run_checks([*vertex_contract_checks(base), *image_checks(),
                                     ("SIGTERM: exit 0", sigterm_exits_0(stop_container))])
        return passed, failed
    finally:
        logs = subprocess.run(["podman", "logs", CONTAINER], capture_output=True, text=True)
        (WORK / "vertex-container.log").write_text(logs.stdout + logs.stderr)
        subprocess.run(["podman", "rm", "--force", CONTAINER], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
