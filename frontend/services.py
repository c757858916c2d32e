"""What the API layers share: config, registry, the inference plane, token authority,
snapshots, the access log."""

from __future__ import annotations

from dataclasses import dataclass

from frontend.api.auth import TokenAuthority
from frontend.config import ServerConfig
from frontend.models.registry import ModelRegistry
from frontend.models.snapshot import Snapshots
from frontend.observe.logs import AccessLog
from frontend.serving.plane import InferencePlane


@dataclass(frozen=True, slots=True)
class Services:
    config: ServerConfig
    registry: ModelRegistry
    auth: TokenAuthority | None
    snapshots: Snapshots
    access: AccessLog
    plane: InferencePlane
