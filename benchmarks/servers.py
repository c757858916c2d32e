"""Start and stop a real batchserve (``torchserve --start``) for a benchmark run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from benchmarks.management import ManagementClient

BIN = Path(sys.executable).parent


class Batchserve(ManagementClient):
    """A background server on free loopback ports, with its own state dir and logs."""

    def __init__(self, model_store: Path, extra_properties: str = "",
                 env: Mapping[str, str] | None = None,
                 workflow_store: Path | None = None) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="bench-"))
        self.env = {**os.environ, **(env or {}),
                    "BATCHSERVE_STATE_DIR": str(self.work / "state")}
        (self.work / "config.properties").write_text(
            "inference_address=http://127.0.0.1:0\nmanagement_address=http://127.0.0.1:0\n"
            "metrics_address=http://127.0.0.1:0\ngrpc_inference_port=0\n"
            "grpc_management_port=0\n" + extra_properties)
        self.model_store = model_store
        self.workflow_store = workflow_store
        self.inference = ""
        self.management = ""
        self.metrics = ""

    def __enter__(self) -> Batchserve:
        workflows = (["--workflow-store", str(self.workflow_store)]
                     if self.workflow_store is not None else [])
        subprocess.run([str(BIN / "torchserve"), "--start", "--model-store",
                        str(self.model_store), "--ts-config", "config.properties",
                        "--enable-model-api", "--disable-token-auth", *workflows],
                       cwd=self.work, env=self.env, check=True, timeout=300,
                       stdout=subprocess.DEVNULL)
        state = json.loads((self.work / "state" / "server.json").read_text())
        self.state: dict[str, object] = state
        self.inference, self.management = state["inference"], state["management"]
        self.metrics = state.get("metrics") or ""
        return self

    def __exit__(self, *_: object) -> None:
        import psutil

        family: list[psutil.Process] = []
        try:
            server = psutil.Process(int(self.state["pid"]))  # type: ignore[call-overload]
            family = [server, *server.children(recursive=True)]
        except (AttributeError, KeyError, psutil.NoSuchProcess):
            pass
        stopped = subprocess.run([str(BIN / "torchserve"), "--stop"], cwd=self.work,
                                 env=self.env, check=False, timeout=300,
                                 stdout=subprocess.DEVNULL)
        # What `--stop` left (it should leave nothing): killed by pid, this server's only.
        _, alive = psutil.wait_procs(family, timeout=60)
        for process in alive:
            print(f"killing batchserve process {process.pid} left behind", file=sys.stderr)
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=10)
        if stopped.returncode != 0:
            raise RuntimeError(f"batchserve --stop failed ({stopped.returncode}); its logs: "
                               f"{self.work}")

    def failure(self, what: str, status: int, text: str) -> Exception:
        return RuntimeError(f"batchserve {what}: {status} {text} (its logs: {self.work})")
