"""Builders for the unit tests of the API layers: one server's ``Services`` assembled as
``Server.serve`` assembles them (frontend/server.py), with no worker process started and no
socket bound, and a direct call of an ASGI app."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from frontend.api.http import common
from frontend.config import ServerConfig
from frontend.models.loader import ModelLoader
from frontend.models.registry import ModelRegistry
from frontend.models.snapshot import Snapshots
from frontend.observe.logs import AccessLog
from frontend.observe.metrics import ServerMetrics
from frontend.ops.plane import InferencePlane
from frontend.ops.services import Services
from frontend.server import observers, statuses
from frontend.serving.placement import GpuAssigner, Placement
from frontend.workflows.loader import WorkflowLoader
from frontend.workflows.registry import WorkflowRegistry

T = TypeVar("T")
_servers = itertools.count()


class NoWorkers(Placement):
    """A placement that refuses to place a worker: a unit test that would start a worker
    process fails at once instead (a model registered or scaled with 0 workers asks none)."""

    def worker_id(self) -> int:
        raise AssertionError("a unit test tried to start a worker process")


def make_services(tmp_path: Path, model_store: Path | None = None,
                  **overrides: object) -> Services:
    """A server's services on ``model_store``, its logs and snapshots under ``tmp_path``:
    no GPU, no token authority, the model API on, no worker process allowed (``NoWorkers``);
    ``overrides`` are ServerConfig fields.

    Build it inside the event loop that uses it (``asyncio.run``), as the server does.
    """
    settings: dict[str, object] = {
        "model_store": model_store,
        "log_location": tmp_path / "logs",
        "enable_model_api": True,
        "disable_token_authorization": True,
        **overrides,
    }
    config = ServerConfig(**settings)  # type: ignore[arg-type]
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700, exist_ok=True)
    registry = ModelRegistry()
    metrics = ServerMetrics(statuses(registry), mode=config.metrics_mode, system_metrics=False,
                            phases=config.request_phases, dispatch_stats=config.dispatch_stats)
    access = AccessLog(None)
    subscribed = observers(metrics, access, None, None)
    loader = ModelLoader(config, run_dir, registry,
                         NoWorkers(GpuAssigner(0), None, registry.worker_count), subscribed,
                         logging.getLogger(f"tests.unit.model{next(_servers)}"))
    snapshots = Snapshots(config.log_location / "config", not config.snapshot_disabled)
    plane = InferencePlane(registry, subscribed, access)
    workflows = WorkflowLoader(config, loader, WorkflowRegistry(), run_dir / "workflows")
    return Services(config, registry, loader, metrics, None, snapshots, plane, workflows)


@dataclass
class Reply:
    """What an ASGI app sent for one request."""

    status: int
    headers: dict[bytes, bytes]
    body: bytes
    #: Every message the app sent, in order.
    messages: list[common.Message] = field(default_factory=list)

    def json(self) -> Any:
        return json.loads(self.body)


def scope(method: str, path: str, query: bytes = b"",
          headers: Iterable[tuple[bytes, bytes]] = ()) -> common.Scope:
    return {"type": "http", "http_version": "1.1", "method": method, "path": path,
            "query_string": query, "headers": list(headers), "client": ("127.0.0.1", 50000)}


async def call(app: common.AsgiApp, method: str, path: str, query: bytes = b"",
               body: bytes = b"", headers: Iterable[tuple[bytes, bytes]] = ()) -> Reply:
    """Call ``app`` with one request whose body comes in one message; a second receive()
    says the client left (as an ASGI server does once the response is sent)."""
    bodies = [{"type": "http.request", "body": body, "more_body": False}]
    messages: list[common.Message] = []

    async def receive() -> common.Message:
        return bodies.pop(0) if bodies else {"type": "http.disconnect"}

    async def send(message: common.Message) -> None:
        messages.append(message)

    await app(scope(method, path, query, headers), receive, send)
    starts = [m for m in messages if m["type"] == "http.response.start"]
    assert len(starts) == 1, f"expected one response, got {messages}"
    body_out = b"".join(m.get("body", b"") for m in messages
                        if m["type"] == "http.response.body")
    return Reply(starts[0]["status"], dict(starts[0]["headers"]), body_out, messages)


def run_with_services(tmp_path: Path, model_store: Path | None,
                      test: Callable[[Services], Awaitable[T]], **overrides: object) -> T:
    """Run ``test`` in a fresh event loop with fresh services (``make_services``), then
    unregister whatever it left registered."""

    async def main() -> T:
        services = make_services(tmp_path, model_store, **overrides)
        try:
            return await test(services)
        finally:
            await services.loader.close(drain_timeout_s=0)

    return asyncio.run(main())
