"""Workers forked from the fork server (docs/workers.md), against the real server: seven
workers of three models running a real conv net on their own OpenMP threads, six of them forked
and one started fresh (model-config.yaml ``workerStart: spawn``) to compare with.

A forked worker must be the worker a fresh interpreter would have been: the same predictions
bit for bit and the same torch random state, its own thread budget, cores, session, signal
handlers, log name and random streams, and no descriptor of the frontend's, the fork server's
or another worker's. The fork server must hold no thread and no GPU context when it forks, and
refuse (workers then start fresh) where it would hold one.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
import yaml

from frontend.serving.placement import visible_gpu_count
from model_archiver.packaging import ArchiveOptions, build_archive
from tests.conftest import HANDLERS, ROOT, RunningServer, launch_server

FORKED_MODELS = ("convnet", "convnet2")
FRESH_MODEL = "fresh"
WORKERS_PER_MODEL = 3
CORES_PER_WORKER = 2
INPUT = {"seed": 7, "batch": 4}
FIXTURES = ROOT / "tests" / "fixtures" / "forkserver"


@dataclass
class Fleet:
    server: RunningServer
    root: Path
    hold: Path

    @property
    def model_log(self) -> Path:
        return self.root / "logs" / "model_log.log"


def _archive(store: Path, name: str, config: dict[str, Any] | None = None) -> None:
    config_file = None
    if config is not None:
        config_file = store.parent / f"{name}.yaml"
        config_file.write_text(yaml.safe_dump(config))
    build_archive(ArchiveOptions(model_name=name, handler=str(HANDLERS / "convnet.py"),
                                 export_path=store, force=True,
                                 config_file=str(config_file) if config_file else None))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("forked")
    store = root / "model_store"
    store.mkdir()
    hold = root / "hold-warmup"
    _archive(store, "convnet")
    _archive(store, "convnet-fresh", {"workerStart": "spawn", "minWorkers": 1})
    _archive(store, "convnet-held", {"handler": {"hold_warmup": str(hold)}})
    # Every worker gets CORES_PER_WORKER cores (fewer on a smaller host), so forked and fresh
    # workers run their conv nets on as many OpenMP threads: their answers can be compared.
    server = launch_server(store, *(f"{name}=convnet.mar" for name in FORKED_MODELS),
                           f"{FRESH_MODEL}=convnet-fresh.mar",
                           default_workers_per_model=WORKERS_PER_MODEL, cpu_affinity=True,
                           cpu_cores_per_worker=CORES_PER_WORKER)
    try:
        yield Fleet(server, root, hold)
    finally:
        server.stop()


def _workers(server: RunningServer, model: str) -> list[dict[str, Any]]:
    return list(server.describe(model)["workers"])  # type: ignore[call-overload]


def _answers(server: RunningServer, model: str) -> dict[int, dict[str, Any]]:
    """One answer from each of ``model``'s workers, by pid: concurrent requests until every
    worker has answered one (bounded)."""
    pids = {int(worker["pid"]) for worker in _workers(server, model)}
    answers: dict[int, dict[str, Any]] = {}
    with ThreadPoolExecutor(2 * len(pids)) as pool:
        for _ in range(30):
            replies = pool.map(lambda _: server.predict(model, json.dumps(INPUT).encode(),
                                                        headers={"Content-Type":
                                                                 "application/json"}),
                               range(2 * len(pids)))
            for reply in replies:
                assert reply.status_code == 200, reply.text
                answer = reply.json()
                answers.setdefault(int(answer["pid"]), answer)
            if pids <= set(answers):
                return {pid: answers[pid] for pid in pids}
    raise AssertionError(f"workers {sorted(pids - set(answers))} of {model} never answered")


def _fork_server(server: RunningServer) -> psutil.Process:
    forkserver = server.server.services.loader.forkserver
    assert forkserver is not None and forkserver.pid is not None
    process = psutil.Process(forkserver.pid)
    assert process.ppid() == os.getpid() and "backend.process.forkserver" in process.cmdline()
    return process


def _sockets(pid: int) -> set[str]:
    """The socket inodes process ``pid`` holds."""
    found = set()
    for entry in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{entry}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


def _descriptors(pid: int) -> dict[int, str]:
    """What process ``pid``'s descriptors are, by number."""
    found = {}
    for entry in os.listdir(f"/proc/{pid}/fd"):
        try:
            found[int(entry)] = os.readlink(f"/proc/{pid}/fd/{entry}")
        except OSError:
            continue
    return found


def test_workers_are_forked_by_a_fork_server_that_preloaded_torch_and_runs_no_thread(
        fleet: Fleet) -> None:
    server = fleet.server
    me = os.getpid()
    forkserver = _fork_server(server)
    for model in FORKED_MODELS:
        workers = _workers(server, model)
        assert len(workers) == WORKERS_PER_MODEL
        for worker in workers:
            assert worker["status"] == "READY" and worker["startMode"] == "forked", worker
            assert worker["loadTimeMs"] > 0
            assert psutil.Process(worker["pid"]).ppid() == forkserver.pid
    [fresh] = _workers(server, FRESH_MODEL)
    assert fresh["startMode"] == "fresh" and fresh["loadTimeMs"] > 0
    assert psutil.Process(fresh["pid"]).ppid() == me
    # It imported torch for the conv net's workers before forking them, and holds no thread
    # (OpenBLAS's, started by numpy's import, stop at each fork) and no GPU device.
    maps = Path(f"/proc/{forkserver.pid}/maps").read_text()
    assert "libtorch_cpu" in maps
    assert os.listdir(f"/proc/{forkserver.pid}/task") == [str(forkserver.pid)]
    assert not any(os.readlink(f"/proc/{forkserver.pid}/fd/{fd}").startswith("/dev/nvidia")
                   for fd in os.listdir(f"/proc/{forkserver.pid}/fd"))


def test_forked_workers_predict_bit_for_bit_as_a_fresh_one_does(fleet: Fleet) -> None:
    server = fleet.server
    [fresh] = _answers(server, FRESH_MODEL).values()
    assert fresh["threads"] == len(fresh["cpus"]) == min(CORES_PER_WORKER, os.cpu_count() or 1)
    forked = [answer for model in FORKED_MODELS for answer in _answers(server, model).values()]
    assert len(forked) == len(FORKED_MODELS) * WORKERS_PER_MODEL
    described = {int(worker["pid"]): worker for model in FORKED_MODELS
                 for worker in _workers(server, model)}
    for answer in forked:
        # The same conv net on the same input, on as many OpenMP threads: the same bits.
        assert base64.b64decode(answer["logits"]) == base64.b64decode(fresh["logits"])
        # Its own thread budget and cores, as the frontend placed it.
        assert answer["cpus"] == described[answer["pid"]]["cpus"]
        assert answer["threads"] == fresh["threads"]
        assert answer["omp_env"] == fresh["omp_env"] == str(fresh["threads"])
        # Signal handlers, session and CUDA as a fresh worker has them.
        for key in ("sigterm", "sigint", "sigchld", "sigpipe", "session_leader",
                    "cuda_initialized"):
            assert answer[key] == fresh[key], key
    assert fresh["session_leader"] and not fresh["cuda_initialized"]
    # No two workers share a random stream: each is seeded afresh, as a fresh interpreter is.
    for stream in ("torch_rand", "numpy_rand", "python_rand"):
        draws = {json.dumps(answer[stream]) for answer in [*forked, fresh]}
        assert len(draws) == len(forked) + 1, stream


def test_a_forked_worker_holds_no_descriptor_of_the_frontend_the_fork_server_or_a_sibling(
        fleet: Fleet) -> None:
    server = fleet.server
    me = os.getpid()
    forked = [int(worker["pid"]) for model in FORKED_MODELS
              for worker in _workers(server, model)]
    [fresh] = [int(worker["pid"]) for worker in _workers(server, FRESH_MODEL)]
    others = {"frontend": _sockets(me), "fork server": _sockets(_fork_server(server).pid)}
    others.update({f"worker {pid}": _sockets(pid) for pid in [*forked, fresh]})
    frontend_pipes = {target for target in _descriptors(me).values()
                      if target.startswith("pipe:")}
    for pid in forked:
        mine = _sockets(pid)
        assert len(mine) == 1, mine  # its connection to the frontend
        for owner, theirs in others.items():
            if owner != f"worker {pid}":
                assert not mine & theirs, f"worker {pid} shares a socket with the {owner}"
        # Besides: stdin from /dev/null, stdout and stderr on pipes the frontend reads, and
        # the pidfd its watchdog watches the frontend by. Nothing else.
        held = _descriptors(pid)
        assert held[0] == "/dev/null"
        assert held[1] != held[2] and {held[1], held[2]} <= frontend_pipes
        rest = sorted(target.split(":[")[0] if target.startswith("socket:") else target
                      for fd, target in held.items() if fd > 2)
        assert rest == ["anon_inode:[pidfd]", "socket"], held


def test_a_forked_workers_output_reaches_the_model_log_under_its_own_name(
        fleet: Fleet) -> None:
    # What its handler prints and what the worker logs (both on its stdout, as TorchServe's
    # worker logs), each line under the worker's own name, as TorchServe's reader thread's.
    server = fleet.server
    for model in FORKED_MODELS:
        for worker in _workers(server, model):
            name = f" W-{worker['id']}-{model}_1.0-stdout MODEL_LOG - "

            def logged(name: str = name, pid: int = worker["pid"], model: str = model) -> bool:
                lines = fleet.model_log.read_text().splitlines()
                return any(f"{name}convnet worker {pid} loaded" in line for line in lines) \
                    and any(f"{name}loading model {model} " in line for line in lines)

            server.wait_for(logged, f"{name}'s lines in the model log")


def test_sigterm_ends_a_forked_worker_as_it_ends_a_fresh_one(fleet: Fleet, caplog) -> None:
    # Its SIGTERM handler is a fresh worker's (compared above): the default action, which
    # ends it; its supervisor sees the death and forks it again.
    server = fleet.server
    [worker] = _workers(server, "convnet2")[:1]
    os.kill(worker["pid"], signal.SIGTERM)

    def replaced() -> bool:
        now = next(w for w in _workers(server, "convnet2") if w["id"] == worker["id"])
        return now["status"] == "READY" and now["pid"] not in (worker["pid"], -1)

    server.wait_for(replaced, "the worker to be replaced", timeout_s=60)
    assert f"(pid {worker['pid']}) exited with code -15" in caplog.text
    restarted = next(w for w in _workers(server, "convnet2") if w["id"] == worker["id"])
    assert restarted["startMode"] == "forked" and restarted["restarts"] == 1


def test_scaling_up_forks_workers_that_answer_as_the_first_ones(fleet: Fleet) -> None:
    server = fleet.server
    scaled = requests.put(f"{server.management}/models/convnet",
                          params={"min_worker": WORKERS_PER_MODEL + 1, "synchronous": "true"},
                          timeout=120)
    assert scaled.status_code == 200, scaled.text
    workers = _workers(server, "convnet")
    assert [w["startMode"] for w in workers] == ["forked"] * (WORKERS_PER_MODEL + 1)
    answers = _answers(server, "convnet")
    assert len({answer["logits"] for answer in answers.values()}) == 1


def test_a_worker_is_ready_only_once_its_warm_up_is_done(fleet: Fleet) -> None:
    server = fleet.server
    fleet.hold.touch()
    registered = requests.post(f"{server.management}/models", params={
        "url": "convnet-held.mar", "initial_workers": 1, "synchronous": "false"}, timeout=60)
    assert registered.status_code == 202, registered.text

    def loaded() -> bool:
        [worker] = _workers(server, "convnet-held")
        return worker["pid"] > 0 and \
            f"convnet worker {worker['pid']} loaded" in fleet.model_log.read_text()

    server.wait_for(loaded, "the held worker to load its model", timeout_s=60)
    held_since = time.monotonic()
    # Loaded, warming up: not READY, no load time yet.
    [worker] = _workers(server, "convnet-held")
    assert worker["status"] == "STARTING" and "loadTimeMs" not in worker
    held_for_ms = (time.monotonic() - held_since) * 1000
    fleet.hold.unlink()
    server.wait_for(lambda: _workers(server, "convnet-held")[0]["status"] == "READY",
                    "the warmed-up worker")
    [worker] = _workers(server, "convnet-held")
    assert worker["loadTimeMs"] >= held_for_ms
    assert server.predict("convnet-held", json.dumps(INPUT).encode(),
                          headers={"Content-Type": "application/json"}).status_code == 200


def test_a_fork_server_with_cuda_initialised_refuses_and_workers_start_fresh(
        build_mar, start_server, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    # A module the fork server imports at start (fork_preload) leaves it as if it had
    # initialised CUDA (tests/fixtures/forkserver/cuda_initialised.py): it must not fork.
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    build_mar("echo", "echo")
    server = start_server("echo.mar", fork_preload=("cuda_initialised",))
    [worker] = server.describe("echo")["workers"]  # type: ignore[misc]
    assert worker["startMode"] == "fresh"
    assert server.predict("echo", b"still served").content == b"still served"
    assert "workers start fresh from now on: CUDA is initialised in the fork server" \
        in caplog.text
    scaled = requests.put(f"{server.management}/models/echo",
                          params={"min_worker": 2, "synchronous": "true"}, timeout=60)
    assert scaled.status_code == 200, scaled.text
    assert [w["startMode"] for w in server.describe("echo")["workers"]] == ["fresh"] * 2  # type: ignore[union-attr]


def test_workers_outlive_their_fork_server_and_the_next_ones_fork_from_a_new_one(
        build_mar, start_server, caplog) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar", default_workers_per_model=2)
    first, second = server.describe("echo")["workers"]  # type: ignore[misc]
    old = _fork_server(server)
    old.kill()  # (not waited for here: the frontend, its parent, reaps it)
    server.wait_for(lambda: "the fork server exited" in caplog.text,
                    "the frontend to see its fork server gone")
    # Its workers go on serving; one that dies now has no fork server to report its status,
    # yet its death is seen at once (its pidfd) and it is forked again, by a new fork server.
    assert server.predict("echo", b"still").content == b"still"
    os.kill(first["pid"], signal.SIGKILL)

    def replaced() -> bool:
        now = server.describe("echo")["workers"][0]  # type: ignore[index]
        return now["status"] == "READY" and now["pid"] not in (first["pid"], -1)

    server.wait_for(replaced, "the killed worker to be replaced", timeout_s=60)
    now = server.describe("echo")["workers"]  # type: ignore[index]
    assert [w["startMode"] for w in now] == ["forked", "forked"]  # type: ignore[index]
    assert now[1]["pid"] == second["pid"]  # type: ignore[index]
    assert _fork_server(server).pid != old.pid
    assert f"(pid {first['pid']}) exited with code -1" in caplog.text
    assert server.predict("echo", b"again").content == b"again"


# ---- on a GPU -------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(visible_gpu_count() == 0, reason="needs a GPU")


@pytest.mark.gpu
@needs_gpu
def test_forked_workers_run_on_the_gpu_and_answer_as_a_fresh_one_does(
        tmp_path: Path) -> None:
    store = tmp_path / "model_store"
    store.mkdir()
    _archive(store, "convnet")
    _archive(store, "convnet-fresh", {"workerStart": "spawn", "minWorkers": 1})
    server = launch_server(store, "convnet=convnet.mar", f"{FRESH_MODEL}=convnet-fresh.mar",
                           default_workers_per_model=2)
    try:
        [fresh] = _answers(server, FRESH_MODEL).values()
        forked = list(_answers(server, "convnet").values())
        assert [w["startMode"] for w in _workers(server, "convnet")] == ["forked"] * 2
        assert fresh["device"].startswith("cuda") and not fresh["cuda_initialized"]
        for answer in forked:
            assert answer["device"].startswith("cuda") and not answer["cuda_initialized"]
            if answer["device"] == fresh["device"]:
                assert answer["logits"] == fresh["logits"]
        # CUDA started in the workers only: the fork server holds no GPU device.
        forkserver = _fork_server(server)
        assert not any(target.startswith("/dev/nvidia")
                       for target in _descriptors(forkserver.pid).values())
    finally:
        server.stop()


@pytest.mark.gpu
@needs_gpu
def test_a_fork_server_that_initialised_cuda_refuses_to_fork(
        build_mar, start_server, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    # tests/fixtures/forkserver/cuda_init.py really initialises CUDA where it is imported.
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    build_mar("echo", "echo")
    server = start_server("echo.mar", fork_preload=("cuda_init",))
    [worker] = server.describe("echo")["workers"]  # type: ignore[misc]
    assert worker["startMode"] == "fresh"
    assert server.predict("echo", b"still served").content == b"still served"
    assert "workers start fresh from now on:" in caplog.text


def _fork_servers_under(pid: int) -> list[psutil.Process]:
    """The fork servers frontend ``pid`` started (its workers show the same command line,
    but are the fork server's children)."""
    found = []
    for child in psutil.Process(pid).children():
        try:
            if "backend.process.forkserver" in child.cmdline():
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def test_the_startup_models_fork_server_starts_first_and_forks_their_workers(
        server_process, model_store: Path) -> None:
    # `torchserve --start` with a startup model: the fork server is started before the
    # server imports its modules and unpacks the archive, reads the archive's handler for
    # what to import (torch, here), and is the one the worker is forked from.
    _archive(model_store, "convnet")
    server = server_process("convnet=convnet.mar")
    log = server.log_text()
    early = log.find("fork server started early (pid ")
    assert 0 <= early < log.find("registered model convnet"), log
    [worker] = requests.get(f"{server.management}/models/convnet",
                            timeout=30).json()[0]["workers"]
    assert worker["startMode"] == "forked"
    [fork_server] = _fork_servers_under(server.process.pid)
    assert f"fork server started early (pid {fork_server.pid})" in log
    assert psutil.Process(worker["pid"]).ppid() == fork_server.pid
    reply = requests.post(f"{server.inference}/predictions/convnet", json=INPUT, timeout=60)
    assert reply.status_code == 200, reply.text
    model_log = (server.log.parent / "logs" / "model_log.log").read_text()
    assert " forkserver-stdout MODEL_LOG - preloaded torch" in model_log


def test_an_early_fork_server_no_startup_worker_needs_is_stopped(
        server_process, model_store: Path) -> None:
    _archive(model_store, "fresh-only", {"workerStart": "spawn"})
    server = server_process("fresh=fresh-only.mar")
    [worker] = requests.get(f"{server.management}/models/fresh",
                            timeout=30).json()[0]["workers"]
    assert worker["startMode"] == "fresh"
    server.wait_for(lambda: not _fork_servers_under(server.process.pid),
                    "the unneeded fork server to stop")
    assert "the fork server started for the startup models was not needed" in \
        server.log_text()
