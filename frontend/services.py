"""What the API layers share: config, registry, token authority, snapshots."""

from __future__ import annotations

from dataclasses import dataclass

from frontend.auth import TokenAuthority
from frontend.config import ServerConfig
from frontend.logs import AccessLog
from frontend.registry import ModelRegistry
from frontend.snapshot import Snapshots


@dataclass(frozen=True, slots=True)
class Services:
    config: ServerConfig
    registry: ModelRegistry
    auth: TokenAuthority | None
    snapshots: Snapshots
    access: AccessLog
