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
``gs://`` (Google's storage library imports); the start log names Vertex's deployment; SIGTERM
ends it with status 0.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from docker.build import (
    STOP_GRACE_S,
    WORK,
    BuildError,
    container_processes,
    podman,
    run_checks,
    ulimits,
    wait_until,
)
from docker.sagemaker_smoke import free_port
from docker.vertex_contract import ENDPOINT, HEALTH, Check, aip_env, artifact_folder, call
from docker.vertex_contract import contract_checks as vertex_contract_checks

CONTAINER = "batchserve-vertex-smoke"
PORT = 7080
STORAGE = "/mnt/artifacts"


def image_checks() -> list[tuple[str, Check]]:
    def processes() -> tuple[bool, str]:
        # The workers (and the fork server they are forked from, also `-m backend`) descend
        # from PID 1, the server itself; every process is uid 1000.
        listed = container_processes(CONTAINER)
        parent = {p[0]: p[1] for p in listed}
        pid1 = next((p for p in listed if p[0] == "1"), None)
        workers = [p for p in listed if "-m backend" in p[3]]

        def from_pid1(pid: str) -> bool:
            seen: set[str] = set()
            while pid not in ("1", "0", "") and pid not in seen:
                seen.add(pid)
                pid = parent.get(pid, "")
            return pid == "1"

        ok = (pid1 is not None and "torchserve" in pid1[3] and bool(workers)
              and all(from_pid1(p[0]) for p in workers) and {p[2] for p in listed} == {"1000"})
        return ok, ((f"PID 1 (uid {pid1[2]}): {pid1[3].strip()}; " if pid1 else "no PID 1; ")
                    + f"{len(workers)} backend processes, parents "
                    + f"{sorted({p[1] for p in workers})}, uids {sorted({p[2] for p in listed})}")

    def storage_library() -> tuple[bool, str]:
        found = subprocess.run(["podman", "exec", CONTAINER, "python3", "-c",
                                "import google.cloud.storage as s; print(s.__version__)"],
                               capture_output=True, text=True)
        return found.returncode == 0, (found.stdout or found.stderr).strip()[-200:]

    def start_log() -> tuple[bool, str]:
        logs = subprocess.run(["podman", "logs", CONTAINER], capture_output=True, text=True)
        line = next((line for line in (logs.stdout + logs.stderr).splitlines()
                     if "Vertex AI:" in line), "")
        ok = f"AIP_ENDPOINT_ID={ENDPOINT}" in line and f"{STORAGE}/model.mar" in line
        return ok, line[-300:] or "no 'Vertex AI:' line"

    return [("PID 1 is the server, as uid 1000; its workers descend from it", processes),
            ("gs:// can be fetched: google.cloud.storage imports", storage_library),
            ("the start log names the model and Vertex's deployment", start_log)]


def sigterm_exits_0() -> tuple[bool, str]:
    start = time.monotonic()
    podman("stop", "--time", str(STOP_GRACE_S), CONTAINER, timeout=STOP_GRACE_S + 60)
    stop_s = time.monotonic() - start
    code = podman("inspect", "--format", "{{.State.ExitCode}}", CONTAINER).strip()
    return code == "0" and stop_s < STOP_GRACE_S, f"status {code} in {stop_s:.1f} s"


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
                                     ("SIGTERM: exit 0", sigterm_exits_0)])
        return passed, failed
    finally:
        logs = subprocess.run(["podman", "logs", CONTAINER], capture_output=True, text=True)
        (WORK / "vertex-container.log").write_text(logs.stdout + logs.stderr)
        subprocess.run(["podman", "rm", "--force", CONTAINER], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
