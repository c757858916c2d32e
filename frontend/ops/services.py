"""What the API layers share: config, registry, loader, the inference plane, metrics, token
authority, snapshots, workflows, the live page's sampler."""

from __future__ import annotations

from dataclasses import dataclass

from frontend.config import ServerConfig
from frontend.models.loader import ModelLoader
from frontend.models.registry import ModelRegistry
from frontend.models.snapshot import Snapshots
from frontend.observe.dashboard import Dashboard
from frontend.observe.metrics import ServerMetrics
from frontend.ops.auth import TokenAuthority
from frontend.ops.plane import InferencePlane
from frontend.workflows.loader import WorkflowLoader


@dataclass(frozen=True, slots=True)
class Services:
    config: ServerConfig
    registry: ModelRegistry
    loader: ModelLoader
    metrics: ServerMetrics
    auth: TokenAuthority | None
    snapshots: Snapshots
    plane: InferencePlane
    #: The workflows (their registry is ``workflows.registry``).
    workflows: WorkflowLoader
    #: The live page's sampler (None: no page data, as in tests that build no server).
    dashboard: Dashboard | None = None
