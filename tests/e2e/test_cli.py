"""The installed ``torchserve`` and ``model-archiver`` commands, run as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import requests

from tests.conftest import gone

pytestmark = pytest.mark.slow  # whole-system: each test starts the installed commands

BIN = Path(sys.executable).parent


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=240,
                          stdin=subprocess.DEVNULL)


def test_start_serve_stop_leaves_no_process_behind(tmp_path: Path) -> None:
    env = {**os.environ, "BATCHSERVE_STATE_DIR": str(tmp_path / "state")}
    handler = Path(__file__).resolve().parent.parent / "fixtures" / "handlers" / "echo.py"
    store = tmp_path / "store"
    store.mkdir()
    # TorchServe's name for the archiver (the last test uses ours, model-archiver).
    archived = _run([str(BIN / "torch-model-archiver"), "--model-name", "echo", "--handler",
                     str(handler), "--export-path", str(store)], env, tmp_path)
    assert archived.returncode == 0, archived.stderr
    (tmp_path / "config.properties").write_text(
        "inference_address=http://127.0.0.1:0\nmanagement_address=http://127.0.0.1:0\n"
        "metrics_address=http://127.0.0.1:0\ngrpc_inference_port=0\ngrpc_management_port=0\n"
        "default_workers_per_model=2\n")

    started = _run([str(BIN / "torchserve"), "--start", "--model-store", str(store),
                    "--models", "echo=echo.mar", "--ts-config", "config.properties",
                    "--disable-token-auth"], env, tmp_path)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert "batchserve started" in started.stdout
        # TorchServe's line, which its launcher (ts.launcher.start) reads the output for.
        assert started.stdout.startswith("Model server started.\n")
        state = json.loads((tmp_path / "state" / "server.json").read_text())
        answer = requests.post(f"{state['inference']}/predictions/echo", data=b"cli", timeout=30)
        assert answer.content == b"cli"
        workers = requests.get(f"{state['management']}/models/echo", timeout=30).json()[0]
        pids = [state["pid"], *(w["pid"] for w in workers["workers"])]
        assert len(pids) == 3 and all(psutil.pid_exists(p) for p in pids)

        again = _run([str(BIN / "torchserve"), "--start", "--model-store", str(store),
                      "--ts-config", "config.properties"], env, tmp_path)
        assert again.returncode != 0
        assert "already running" in again.stderr
    finally:
        stopped = _run([str(BIN / "torchserve"), "--stop"], env, tmp_path)
    assert stopped.returncode == 0
    assert "stopped" in stopped.stdout
    for pid in pids:
        assert gone(pid)
    assert not (tmp_path / "state" / "server.json").exists()

    second = _run([str(BIN / "torchserve"), "--stop"], env, tmp_path)
    assert second.returncode == 0
    assert "not running" in second.stdout


def test_start_fails_clearly_on_a_bad_config_value(tmp_path: Path) -> None:
    env = {**os.environ, "BATCHSERVE_STATE_DIR": str(tmp_path / "state")}
    (tmp_path / "store").mkdir()
    (tmp_path / "bad.properties").write_text("job_queue_size=lots\n")
    result = _run([str(BIN / "torchserve"), "--start", "--model-store", "store",
                   "--ts-config", "bad.properties"], env, tmp_path)
    assert result.returncode != 0
    assert "job_queue_size" in result.stderr


def test_start_reports_a_port_in_use(tmp_path: Path) -> None:
    import socket

    env = {**os.environ, "BATCHSERVE_STATE_DIR": str(tmp_path / "state")}
    (tmp_path / "store").mkdir()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        (tmp_path / "c.properties").write_text(
            f"inference_address=http://127.0.0.1:{port}\nmanagement_address=http://127.0.0.1:0\n"
            "metrics_address=http://127.0.0.1:0\ngrpc_inference_port=0\ngrpc_management_port=0\n")
        result = _run([str(BIN / "torchserve"), "--start", "--model-store", "store",
                       "--ts-config", "c.properties"], env, tmp_path)
    assert result.returncode != 0
    assert "cannot bind" in result.stderr + result.stdout


def test_foreground_server_stops_on_sigterm_via_stop(tmp_path: Path) -> None:
    import time

    env = {**os.environ, "BATCHSERVE_STATE_DIR": str(tmp_path / "state")}
    (tmp_path / "store").mkdir()
    (tmp_path / "config.properties").write_text(
        "inference_address=http://127.0.0.1:0\nmanagement_address=http://127.0.0.1:0\n"
        "metrics_address=http://127.0.0.1:0\ngrpc_inference_port=0\ngrpc_management_port=0\n")
    server = subprocess.Popen([str(BIN / "torchserve"), "--start", "--foreground",
                               "--model-store", "store"], env=env, cwd=tmp_path,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    try:
        state_file = tmp_path / "state" / "server.json"
        deadline = time.monotonic() + 60
        while not state_file.exists():
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        stopped = _run([str(BIN / "torchserve"), "--stop"], env, tmp_path)
        assert stopped.returncode == 0 and "stopped" in stopped.stdout
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
        assert server.stdout is not None
        server.stdout.close()


def test_after_the_frontend_is_killed_its_workers_exit_and_a_new_start_works(
        tmp_path: Path) -> None:
    import signal
    import time

    env = {**os.environ, "BATCHSERVE_STATE_DIR": str(tmp_path / "state")}
    handler = Path(__file__).resolve().parent.parent / "fixtures" / "handlers" / "echo.py"
    store = tmp_path / "store"
    store.mkdir()
    assert _run([str(BIN / "model-archiver"), "--model-name", "echo", "--handler", str(handler),
                 "--export-path", str(store)], env, tmp_path).returncode == 0
    (tmp_path / "config.properties").write_text(
        "inference_address=http://127.0.0.1:0\nmanagement_address=http://127.0.0.1:0\n"
        "metrics_address=http://127.0.0.1:0\ngrpc_inference_port=0\ngrpc_management_port=0\n")
    start = [str(BIN / "torchserve"), "--start", "--model-store", str(store), "--models",
             "echo=echo.mar", "--ts-config", "config.properties", "--disable-token-auth"]
    assert _run(start, env, tmp_path).returncode == 0
    state = json.loads((tmp_path / "state" / "server.json").read_text())
    described = requests.get(f"{state['management']}/models/echo", timeout=30).json()[0]
    worker_pids = [w["pid"] for w in described["workers"]]
    # The worker was forked by the fork server, a child of the frontend: it goes too.
    [forkserver] = [child.pid for child in psutil.Process(state["pid"]).children()
                    if "backend.process.forkserver" in child.cmdline()]
    assert psutil.Process(worker_pids[0]).ppid() == forkserver
    os.kill(state["pid"], signal.SIGKILL)

    deadline = time.monotonic() + 10
    while not all(gone(p) for p in [*worker_pids, forkserver]):
        assert time.monotonic() < deadline, "workers or their fork server outlived the frontend"
        time.sleep(0.05)

    restarted = _run(start, env, tmp_path)  # the stale state file is not in the way
    try:
        assert restarted.returncode == 0, restarted.stdout + restarted.stderr
        state = json.loads((tmp_path / "state" / "server.json").read_text())
        answer = requests.post(f"{state['inference']}/predictions/echo", data=b"again",
                               timeout=30)
        assert answer.content == b"again"
    finally:
        assert _run([str(BIN / "torchserve"), "--stop"], env, tmp_path).returncode == 0


def test_make_demo_takes_other_ports() -> None:
    """``make demo PORT=8180 GRPC_PORT=7170``: the demo's config.properties with the
    variables the Makefile passes serves on 8180/8181/8182 and gRPC 7170/7171."""
    root = Path(__file__).resolve().parents[2]
    dry = subprocess.run(["make", "-n", "-s", "demo", "PORT=8180", "GRPC_PORT=7170"], cwd=root,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    command = next(line for line in dry.splitlines() if "torchserve --start" in line)
    environ = dict(word.split("=", 1) for word in command.split() if word.startswith("TS_"))
    assert "8180" in dry.split("curl", 1)[1].splitlines()[0]  # the line it tells you to try
    from frontend.config import load_config

    config = load_config(root / "config.properties", {}, environ)
    assert (config.inference_address.port, config.management_address.port,
            config.metrics_address.port) == (8180, 8181, 8182)
    assert (config.grpc_inference_port, config.grpc_management_port) == (7170, 7171)
    assert load_config(root / "config.properties", {}, {}).inference_address.port == 8080


DECOYS = ("frontend", "backend", "protos", "model_archiver", "ts", "pip", "venv")


def _decoys(folder: Path) -> None:
    """Packages named like ours (and pip's, venv's) that fail loudly when imported."""
    for name in DECOYS:
        (folder / name).mkdir(parents=True)
        for module in ("__init__.py", "__main__.py"):
            (folder / name / module).write_text(
                f"raise SystemExit('the decoy {name} was imported from ' + __file__)\n")


def test_start_from_a_folder_with_decoys_of_our_packages(tmp_path: Path) -> None:
    """From the root of a pytorch/serve checkout (it has frontend/) or any folder holding
    folders named like our packages, ``torchserve --start`` (in the background) and its
    workers import our own; nor does a model's archive shadow them (or pip)."""
    env = {**os.environ, "BATCHSERVE_STATE_DIR": str(tmp_path / "state")}
    checkout = tmp_path / "serve"
    _decoys(checkout)
    archive_decoys = tmp_path / "archive-decoys"
    _decoys(archive_decoys)
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("# nothing to install: pip still runs in the model's folder\n")
    handler = Path(__file__).resolve().parent.parent / "fixtures" / "handlers" / "uses_ts.py"
    store = checkout / "model_store"
    store.mkdir()
    archived = _run([str(BIN / "torch-model-archiver"), "--model-name", "decoyed",
                     "--handler", str(handler), "--extra-files", str(archive_decoys),
                     "--requirements-file", str(requirements), "--export-path", str(store)],
                    env, checkout)
    assert archived.returncode == 0, archived.stderr
    (checkout / "config.properties").write_text(
        "inference_address=http://127.0.0.1:0\nmanagement_address=http://127.0.0.1:0\n"
        "metrics_address=http://127.0.0.1:0\ngrpc_inference_port=0\ngrpc_management_port=0\n"
        "install_py_dep_per_model=true\ndisable_token_authorization=true\n")
    started = _run([str(BIN / "torchserve"), "--start", "--ncs", "--model-store", "model_store",
                    "--models", "decoyed=decoyed.mar", "--ts-config", "config.properties"],
                   env, checkout)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        # The banner names what turned token authorization off: here the config key.
        assert ("token keys:     off (disable_token_authorization=true in config.properties)"
                in started.stdout), started.stdout
        state = json.loads((tmp_path / "state" / "server.json").read_text())
        answer = requests.post(f"{state['inference']}/predictions/decoyed", data=b"hi",
                               timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["body"] == "hi"
        assert "decoy" not in answer.json()["ts"] and str(tmp_path) not in answer.json()["ts"]
    finally:
        stopped = _run([str(BIN / "torchserve"), "--stop"], env, checkout)
    assert stopped.returncode == 0
    logs = "\n".join(path.read_text(errors="replace")
                     for path in (checkout / "logs").glob("*.log"))
    assert "decoy" not in logs.replace("decoyed", ""), logs[-3000:]
