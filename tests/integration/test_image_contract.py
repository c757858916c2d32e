"""The images' contract, held in ``make test``: the checks the image smoke tests run against a
container (docker/contract.py, docker/sagemaker_contract.py), run here against the server
started outside any container, as each image starts it (issue 38).

The KServe image: its CMD, or KServe's args and env for each protocol, with the image's ENV
(read from docker/Dockerfile), on the smoke test's /mnt/models layout in a temporary folder,
bound to free loopback ports. The server is the process started (PID 1 in the image), its
workers are its descendants, SIGTERM ends it with status 0.

The SageMaker image: the toolkit's ``serve`` run through the image's entry point
(docker/sagemaker-entrypoint.sh) with the image's ENV (docker/Dockerfile.sagemaker), the
smoke test's model directories, in a PID namespace of its own where this machine allows one
(as a container is; the process checks need it). tests/integration/test_sagemaker.py starts
it; the toolkit's venv is made by ``make test`` (these tests skip without it, as those do).

A change to the server that breaks what an image promises fails here, not at the next
``make image``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil
import pytest

from docker.build import DOCKERFILE, SAGEMAKER_DOCKERFILE, SAGEMAKER_ENTRYPOINT
from docker.contract import (
    KSERVE_ARGS,
    PROCESS_LISTING,
    SMOKE_MODEL,
    Check,
    KServeEndpoints,
    Ports,
    Process,
    described_workers,
    http,
    image_command,
    image_env,
    kserve_checks,
    kserve_env,
    kserve_layout,
    kserve_ready_url,
    parse_processes,
    server_and_workers,
    sigterm_exits_0,
)
from docker.sagemaker_contract import (
    MULTI,
    SINGLE,
    Toolkit,
    multi_model_checks,
    single_model_checks,
)
from tests.conftest import START_TIMEOUT_S, terminate
from tests.integration.test_sagemaker import Container, free_port, start_serve

BIN = Path(sys.executable).parent


def listed(prefix: list[str]) -> list[Process]:
    """The processes, listed as the smoke tests list a container's (``prefix``: where). A
    command line is any bytes (another process's may not be UTF-8): undecodable ones replaced."""
    listing = subprocess.run([*prefix, "sh", "-c", PROCESS_LISTING], capture_output=True,
                             text=True, errors="replace", timeout=60, check=True).stdout
    return parse_processes(listing)


def host_processes() -> list[Process]:
    return listed([])


def assert_all_pass(checks: Sequence[tuple[str, Check]]) -> None:
    """Every check, in order (a later one may stop the server); the failures named."""
    failures = []
    for name, check in checks:
        ok, detail = check()
        if not ok:
            failures.append(f"{name}: {detail}")
    assert not failures, "\n".join(failures)


# ---- the KServe image -----------------------------------------------------------------------


def outside(argument: str, mnt: Path) -> str:
    """An argument of the image's command, its /mnt/models and ``torchserve`` made this
    machine's."""
    if argument == "torchserve":
        return str(BIN / "torchserve")
    return argument.replace("/mnt/models", str(mnt))


def test_a_process_whose_command_line_is_not_utf8_is_listed() -> None:
    """Another process on the host (CI's own, say) may have any bytes in its command line."""
    odd = subprocess.Popen([b"sleep-\x80\xff", b"30"], executable="sleep")
    try:
        found = [p for p in host_processes() if p.pid == odd.pid]
        assert [p.command for p in found] == ["sleep-\ufffd\ufffd 30 "]
    finally:
        odd.kill()
        odd.wait()


@pytest.mark.parametrize("protocol", [None, "v1", "v2", "grpc-v2"])
def test_the_kserve_images_contract_holds_outside_the_image(tmp_path: Path,
                                                            protocol: str | None) -> None:
    mnt = tmp_path / "mnt" / "models"
    mnt.mkdir(parents=True)
    ports = Ports(port=free_port(), metrics_port=free_port(), grpc_port=free_port(),
                  grpc_management_port=free_port())
    kserve_layout(mnt, "127.0.0.1", ports)
    # The image's CMD, or the args KServe's runtime replaces it with.
    command = list(KSERVE_ARGS) if protocol else image_command(DOCKERFILE)
    kserve_ports = {"TS_KSERVE_REST_PORT": str(free_port()),
                    "TS_KSERVE_GRPC_PORT": str(free_port())} if protocol else {}
    env = {**os.environ, **image_env(DOCKERFILE), **kserve_env(protocol), **kserve_ports,
           "BATCHSERVE_STATE_DIR": str(tmp_path / "state")}
    local = "http://127.0.0.1"
    at = KServeEndpoints(
        inference=f"{local}:{ports.port}",
        kserve_rest=f"{local}:{kserve_ports.get('TS_KSERVE_REST_PORT', ports.port)}",
        kserve_grpc_port=int(kserve_ports.get("TS_KSERVE_GRPC_PORT", ports.grpc_port)),
        metrics=f"{local}:{ports.metrics_port}", protocol=protocol)
    with (tmp_path / "output.log").open("wb") as out:
        server = subprocess.Popen([outside(arg, mnt) for arg in command], cwd=tmp_path,
                                  env=env, stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: http("GET", kserve_ready_url(at), timeout=5)[0] == 200, server,
                 tmp_path / "output.log")
        assert_all_pass([
            *kserve_checks(at),
            ("the process started is the server; its workers its descendants; one uid",
             lambda: server_and_workers(host_processes(), server.pid, os.getuid(),
                                        described_workers(at.inference, SMOKE_MODEL),
                                        alone=False)),
            ("SIGTERM drains and exits 0", sigterm_exits_0(lambda: terminate(server)))])
    finally:
        terminate(server)
        stop_a_server_that_went_to_the_background(tmp_path / "state", server, env)


def stop_a_server_that_went_to_the_background(state_dir: Path, started: subprocess.Popen[bytes],
                                              env: dict[str, str]) -> None:
    """Where the contract broke because ``torchserve`` left the server in the background, that
    server is stopped too (``torchserve --stop``, by the state file)."""
    try:
        pid = json.loads((state_dir / "server.json").read_text()).get("pid")
    except (OSError, ValueError):
        return
    if pid != started.pid:
        subprocess.run([str(BIN / "torchserve"), "--stop"], env=env, capture_output=True,
                       timeout=240, check=False)


def wait_for(ready: Callable[[], bool], server: subprocess.Popen[bytes], output: Path) -> None:
    """Poll ``ready`` until it holds; fail when the server exits or the time is up."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if ready():
                return
        except OSError:
            pass
        assert server.poll() is None, f"exited {server.returncode}:\n{output.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"not ready in time:\n{output.read_text()[-3000:]}"
        time.sleep(0.1)


# ---- the SageMaker image --------------------------------------------------------------------


def serve_pid(container: Container) -> int:
    """``serve``'s PID (in a PID namespace, ``unshare``'s child: the namespace's PID 1)."""
    if not container.isolated:
        return container.serve.pid
    return int(psutil.Process(container.serve.pid).children()[0].pid)


def toolkit(container: Container) -> Toolkit:
    """The contract's view of ``serve`` started here. In a PID namespace the processes are
    listed from inside it (``nsenter``, as ``podman exec`` lists a container's): ``serve`` is
    PID 1 there, and describe's worker PIDs are that namespace's."""
    work = container.work
    pid = serve_pid(container)
    if container.isolated:
        def processes() -> list[Process]:
            return listed(["nsenter", "--target", str(pid), "--pid", "--mount"])
    else:
        def processes() -> list[Process]:
            return listed([])
    return Toolkit(
        base=container.url,
        env={key: value for key, value in container.env.items()
             if key.startswith("SAGEMAKER_")},
        cpus=int(subprocess.run(["nproc"], env=container.env, capture_output=True, text=True,
                                check=True).stdout),
        config=lambda: (work / "sagemaker-ts.properties").read_text(),
        processes=processes, serve=1 if container.isolated else pid, serve_program="serve.py",
        environ=lambda: Path(f"/proc/{pid}/environ").read_bytes().decode(
            errors="replace").replace("\0", "\n"),
        uid=os.getuid(), alone=container.isolated,
        output=lambda: (work / "serve.out").read_text(errors="replace"),
        ts_log=lambda: (work / "logs" / "ts_log.log").read_text(errors="replace"),
        stop=container.stop)


#: The image's environment, and what ``nproc`` (the entry point's worker count) reads: two
#: workers wherever this runs.
SAGEMAKER_ENV = {**image_env(SAGEMAKER_DOCKERFILE), "OMP_NUM_THREADS": "2"}


def start(root: Path, **environ: str) -> Container:
    return start_serve(root / "work", root / "ml", entrypoint=SAGEMAKER_ENTRYPOINT,
                       **{**SAGEMAKER_ENV, **environ})


def without_process_checks(checks: list[tuple[str, Check]], container: Container
                           ) -> list[tuple[str, Check]]:
    """Outside a PID namespace the server ``torchserve --start`` leaves behind is the
    machine's init's, not ``serve``'s: the process check needs the namespace."""
    if container.isolated:
        return checks
    return [(name, check) for name, check in checks if "is the root" not in name]


def test_the_sagemaker_images_single_model_contract_holds_outside_the_image(
        tmp_path: Path) -> None:
    SINGLE.write(tmp_path / "ml" / "model")
    container = start(tmp_path)
    try:
        assert_all_pass(without_process_checks(single_model_checks(toolkit(container)),
                                               container))
    finally:
        container.stop()


def test_the_sagemaker_images_multi_model_contract_holds_outside_the_image(
        tmp_path: Path) -> None:
    models = tmp_path / "ml" / "models"
    for name, weights in MULTI.items():
        weights.write(models / name / "model")
    # One worker a model (nproc reads OMP_NUM_THREADS): each model's workers load torch.
    container = start(tmp_path, SAGEMAKER_MULTI_MODEL="true", OMP_NUM_THREADS="1")
    try:
        assert_all_pass(multi_model_checks(toolkit(container),
                                           lambda name: str(models / name / "model")))
    finally:
        container.stop()
