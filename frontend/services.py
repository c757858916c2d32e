"""What the API layers share: config, registry, token authority, snapshots."""

from __future__ import annotations

from dataclasses import dataclass

from frontend.api.auth import TokenAuthority
from frontend.config import ServerConfig
from frontend.models.registry import ModelRegistry
from frontend.models.snapshot import Snapshots
from frontend.observe.logs import AccessLog


@dataclass(frozen=True, slots=True)
class Services:
    config: ServerConfig
    registry: ModelRegistry
    auth: TokenAuthority | None
    snapshots: Snapshots
    access: AccessLog
