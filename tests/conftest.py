"""Shared fixtures: archives built by our model-archiver, and real servers on free ports."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests

# As `torchserve --start` does (frontend/cli.py): servers in this process fork workers while
# grpc threads run. grpcio reads this when first imported, which is just below.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from frontend.config import Address, ServerConfig
from frontend.server import Server
from model_archiver.packaging import ArchiveOptions, build_archive

ROOT = Path(__file__).resolve().parent.parent
HANDLERS = ROOT / "tests" / "fixtures" / "handlers"
START_TIMEOUT_S = 60.0


@pytest.fixture
def model_store(tmp_path: Path) -> Path:
    store = tmp_path / "model_store"
    store.mkdir()
    return store


@pytest.fixture
def build_mar(model_store: Path) -> Callable[..., Path]:
    """Build an archive of a fixture handler into the test's model store."""

    def build(name: str, handler: str, *, version: str = "1.0", fmt: str = "default",
              extra_files: tuple[str, ...] = (), config_file: Path | None = None) -> Path:
        module, _, function = handler.partition(":")
        handler_path = HANDLERS / f"{module}.py"
        return build_archive(ArchiveOptions(
            model_name=name, version=version,
            handler=f"{handler_path}:{function}" if function else str(handler_path),
            extra_files=extra_files, export_path=model_store, archive_format=fmt, force=True,
            config_file=str(config_file) if config_file else None))

    return build


@dataclass
class RunningServer:
    server: Server
    thread: threading.Thread
    inference: str
    management: str
    metrics: str
    grpc_inference_port: int | None = None
    grpc_management_port: int | None = None

    def predict(self, model: str, body: bytes = b"", **kwargs: object) -> requests.Response:
        return requests.post(f"{self.inference}/predictions/{model}", data=body, timeout=60,
                             **kwargs)  # type: ignore[arg-type]

    def describe(self, model: str) -> dict[str, object]:
        response = requests.get(f"{self.management}/models/{model}", timeout=30)
        response.raise_for_status()
        return response.json()[0]  # type: ignore[no-any-return]

    def wait_for(self, predicate: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
        """Poll ``predicate`` until it holds, failing the test after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.01)

    def hold_gate(self, pool: ThreadPoolExecutor, gate: Path, queued: int = 0,
                  model: str = "gate") -> list[Future[requests.Response]]:
        """With the ``gate`` fixture handler: one request that waits in the worker until the
        file ``gate`` exists, then ``queued`` more waiting in the queue behind it."""
        held = [pool.submit(self.predict, model, str(gate).encode())]
        self.wait_for(lambda: self.describe(model)["batching"]["inFlightBatches"] == 1,  # type: ignore[index]
                      "the first request to reach the worker")
        for count in range(1, queued + 1):
            held.append(pool.submit(self.predict, model, str(gate).encode()))
            self.wait_for(
                lambda count=count: self.describe(model)["jobQueueStatus"]["pendingRequests"]  # type: ignore[index,misc]
                == count, f"{count} queued request(s)")
        return held

    def stop(self) -> None:
        self.server.request_stop()
        self.thread.join(timeout=120)
        assert not self.thread.is_alive(), "server did not stop"


def _run(server: Server) -> None:
    import uvloop

    uvloop.run(server.serve())


def launch_server(model_store: Path, *models: str, **overrides: object) -> RunningServer:
    """Start a real server (real worker subprocesses) on free loopback ports."""
    started = threading.Event()
    server = Server(server_config(model_store, *models, **overrides),
                    on_started=lambda _: started.set())
    thread = threading.Thread(target=_run, args=(server,), daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not started.wait(0.05):
        if not thread.is_alive() or time.monotonic() > deadline:
            raise AssertionError("server failed to start")
    assert server.bound is not None and server.bound.metrics is not None
    return RunningServer(server, thread, str(server.bound.inference),
                         str(server.bound.management), str(server.bound.metrics),
                         server.bound.grpc_inference_port, server.bound.grpc_management_port)


@pytest.fixture
def start_server(model_store: Path) -> Iterator[Callable[..., RunningServer]]:
    """Start servers on the test's model store; each is stopped at teardown."""
    running: list[RunningServer] = []

    def start(*models: str, **overrides: object) -> RunningServer:
        handle = launch_server(model_store, *models, **overrides)
        running.append(handle)
        return handle

    yield start
    for handle in running:
        handle.stop()


@dataclass
class ServerProcess:
    """A server started as a user starts it (``torchserve --start --foreground``), in its own
    process: a crash of the frontend shows as its exit code instead of taking the test run
    down with it."""

    process: subprocess.Popen[bytes]
    inference: str
    management: str
    metrics: str
    grpc_inference_port: int
    grpc_management_port: int
    log: Path

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, predicate: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
        RunningServer.wait_for(self, predicate, what, timeout_s)  # type: ignore[arg-type]

    def stop(self) -> int:
        return terminate(self.process)


def gone(pid: int) -> bool:
    """No process ``pid`` runs: none, or a zombie (one that ends between the two looks
    counts as gone, not as an error)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def terminate(process: subprocess.Popen[bytes], timeout_s: float = 60) -> int:
    """SIGTERM a server process and wait for it (SIGKILL after ``timeout_s``); its status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def spawn_server(work_dir: Path, model_store: Path, *models: str,
                 config: dict[str, object] | None = None,
                 flags: tuple[str, ...] = ("--disable-token-auth",),
                 env: dict[str, str] | None = None) -> ServerProcess:
    """Start ``torchserve --start --foreground`` on free loopback ports and wait until it
    answers; ``config`` adds config.properties keys, ``flags`` are more command-line flags
    (by default ``--disable-token-auth``), ``env`` more environment variables."""
    settings: dict[str, object] = {
        "inference_address": "http://127.0.0.1:0", "management_address": "http://127.0.0.1:0",
        "metrics_address": "http://127.0.0.1:0", "grpc_inference_port": 0,
        "grpc_management_port": 0, "default_workers_per_model": 1, "enable_model_api": "true",
        "log_location": work_dir / "logs", "number_of_netty_threads": 1, **(config or {})}
    properties = work_dir / "config.properties"
    properties.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))
    state_dir = work_dir / "state"
    log = work_dir / "server.log"
    command = [str(Path(sys.executable).parent / "torchserve"), "--start", "--foreground",
               "--model-store", str(model_store), "--ts-config", str(properties), *flags]
    if models:
        command += ["--models", *models]
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=work_dir, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT,
                                   env={**os.environ, "BATCHSERVE_STATE_DIR": str(state_dir),
                                        **(env or {})})
    deadline = time.monotonic() + START_TIMEOUT_S
    state_file = state_dir / "server.json"
    while True:
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}: "
                                 f"{log.read_text(errors='replace')[-2000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("server did not start in time")
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError):
            state = {}
        if state.get("pid") == process.pid:
            return ServerProcess(process, state["inference"], state["management"],
                                 state["metrics"], state["grpc_inference_port"],
                                 state["grpc_management_port"], log)
        time.sleep(0.05)


@pytest.fixture
def server_process(tmp_path: Path, model_store: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Start servers in processes of their own; each is stopped at teardown."""
    running: list[ServerProcess] = []

    def start(*models: str, config: dict[str, object] | None = None) -> ServerProcess:
        work_dir = tmp_path / f"server{len(running)}"
        work_dir.mkdir()
        handle = spawn_server(work_dir, model_store, *models, config=config)
        running.append(handle)
        return handle

    yield start
    for handle in running:
        handle.stop()


# ---- a server on the test's own event loop ----------------------------------------------------

STOP_TIMEOUT_S = 120.0


def server_config(model_store: Path, *models: str, **overrides: object) -> ServerConfig:
    """``launch_server``'s configuration: free loopback ports, one worker per model, the
    model API on, no token, logs beside the model store; ``overrides`` are ServerConfig
    fields."""
    settings: dict[str, object] = {
        "inference_address": Address("127.0.0.1", 0),
        "management_address": Address("127.0.0.1", 0),
        "metrics_address": Address("127.0.0.1", 0),
        "grpc_inference_port": 0,
        "grpc_management_port": 0,
        "model_store": model_store,
        "load_models": models,
        "default_workers_per_model": 1,
        "enable_model_api": True,
        "disable_token_authorization": True,
        "log_location": model_store.parent / "logs",
        # One process on the inference port, whatever the host's cores (tests/integration/
        # test_fronts.py asks for more).
        "number_of_netty_threads": 1,
        **overrides,
    }
    return ServerConfig(**settings)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def serving(model_store: Path, *models: str, **overrides: object
                  ) -> AsyncIterator[Server]:
    """Run a real server (real worker subprocesses, ``server_config``) on the running event
    loop until the block ends: a test calls ``server.services`` (the plane, the loader, the
    metrics) directly, in the server's own loop, with no transport in between."""
    loop = asyncio.get_running_loop()
    started: asyncio.Future[None] = loop.create_future()

    def on_started(_: Server) -> None:
        if not started.done():
            started.set_result(None)

    server = Server(server_config(model_store, *models, **overrides), on_started=on_started)
    task = asyncio.ensure_future(server.serve())
    try:
        done, _ = await asyncio.wait({started, task}, timeout=START_TIMEOUT_S,
                                     return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            error = task.exception()
            raise AssertionError(f"server.serve() ended before the server started: {error!r}"
                                 ) from error
        if not done:
            raise AssertionError(f"the server did not start within {START_TIMEOUT_S} s")
        assert server.services is not None and server.bound is not None
        yield server
    finally:
        started.cancel()
        if not task.done():
            server.request_stop()
            try:
                # wait_for cancels serve() if it overruns: its cleanup still runs.
                await asyncio.wait_for(task, STOP_TIMEOUT_S)
            except TimeoutError:
                raise AssertionError(f"the server did not stop within {STOP_TIMEOUT_S} s"
                                     ) from None


@pytest.fixture
def async_server(model_store: Path
                 ) -> Callable[..., contextlib.AbstractAsyncContextManager[Server]]:
    """``async with async_server("echo.mar", **overrides) as server:`` runs a server on the
    test's event loop (``serving`` on the test's model store); it stops when the block ends."""
    return functools.partial(serving, model_store)
