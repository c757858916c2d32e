"""The server's health, as TorchServe's ``/ping`` (REST) and ``Ping`` (gRPC) report it:
healthy when every registered model is (a model with no worker is not failing)."""

from __future__ import annotations

from frontend.models.registry import ModelRegistry

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


def ping(registry: ModelRegistry) -> tuple[bool, dict[str, str]]:
    """Whether the server is healthy, and TorchServe's body saying so."""
    healthy = all(model.is_healthy() for model in registry)
    return healthy, {"status": HEALTHY if healthy else UNHEALTHY}
