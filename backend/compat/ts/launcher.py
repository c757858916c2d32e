"""``ts.launcher``: start and stop a model server from Python, and register models with it.

It runs the ``torchserve`` command on ``PATH`` (batchserve's, where batchserve is installed)
and talks to the management API on localhost:8081, as TorchServe's does. ``start`` returns
once the server says it is up (TorchServe's "Model server started", or batchserve's
"batchserve started") and then echoes the rest of the server's output. Needs ``requests``
at import, as TorchServe's module does.
"""

from __future__ import annotations

import subprocess
import threading
from io import TextIOWrapper
from queue import Empty, Full, Queue
from subprocess import PIPE, STDOUT, Popen
from typing import IO, Any

from backend.optional import require

requests = require("requests", "ts.launcher")

#: Lines that say the server is up: TorchServe's log line, batchserve's start message.
STARTED = ("Model server started", "batchserve started")
MANAGEMENT_URL = "http://localhost:8081"


def stop(wait: bool = True) -> None:
    """``torchserve --stop`` (with ``--foreground``: wait until it has stopped)."""
    subprocess.run(["torchserve", "--stop", *(["--foreground"] if wait else [])], check=False)


class Tee(threading.Thread):
    """Copies each line of ``reader`` into two queues of 1000 lines (a full queue drops the
    line); both end with None."""

    def __init__(self, reader: IO[str]) -> None:
        super().__init__(daemon=True)
        self.reader = reader
        self.queue1: Queue[str | None] = Queue(maxsize=1000)
        self.queue2: Queue[str | None] = Queue(maxsize=1000)

    def run(self) -> None:
        for line in self.reader:
            for queue in (self.queue1, self.queue2):
                try:
                    queue.put_nowait(line)
                except Full:
                    pass
        for queue in (self.queue1, self.queue2):
            if queue.full():  # make room for the end marker
                try:
                    while True:
                        queue.get_nowait()
                except Empty:
                    pass
            queue.put_nowait(None)


class PrintTillTheEnd(threading.Thread):
    """Prints the lines of ``queue`` until its end marker."""

    def __init__(self, queue: Queue[str | None]) -> None:
        super().__init__(daemon=True)
        self._queue = queue

    def run(self) -> None:
        while line := self._queue.get():
            print(line.strip())


def start(model_store: str | None = None, snapshot_file: str | None = None,
          no_config_snapshots: bool = False, plugin_folder: str | None = None,
          disable_token: bool = False, models: str | None = None,
          enable_model_api: bool = False) -> Queue[str | None]:
    """Stop any running server, start one with these options, wait until it is up; returns
    a queue of the server's further output lines (None at its end)."""
    stop()
    command = ["torchserve", "--start"]
    if model_store:
        command += ["--model-store", model_store]
    if plugin_folder:
        command += ["--plugins-path", plugin_folder]
    if snapshot_file:
        command += ["--ts-config", snapshot_file]
    if no_config_snapshots:
        command.append("--no-config-snapshots")
    if disable_token:
        command.append("--disable-token-auth")
    if models:
        command += ["--models", models]
    if enable_model_api:
        command.append("--enable-model-api")
    process = Popen(command, stdin=PIPE, stdout=PIPE, stderr=STDOUT)
    assert process.stdout is not None
    output = TextIOWrapper(process.stdout, encoding="utf-8", errors="replace")
    for line in output:
        print(line.strip())
        if any(marker in line for marker in STARTED):
            break
    splitter = Tee(output)
    splitter.start()
    PrintTillTheEnd(splitter.queue1).start()
    return splitter.queue2


def register_model_with_params(params: Any) -> Any:
    """``POST /models`` on the management API with these query parameters."""
    return requests.post(f"{MANAGEMENT_URL}/models", params=params)


def register_model(model_name: str, url: str) -> Any:
    """Register ``url`` as ``model_name`` with one worker, waiting until it is loaded."""
    return register_model_with_params((("model_name", model_name), ("url", url),
                                       ("initial_workers", "1"), ("synchronous", "true")))
