"""``ts.torch_handler.request_envelope.body``: each request's body (its ``data`` or ``body``
input) is a row; the results are the answers."""

from __future__ import annotations

from typing import Any

from .base import BaseEnvelope

__all__ = ["BaseEnvelope", "BodyEnvelope"]


class BodyEnvelope(BaseEnvelope):
    """The request bodies as a plain list."""

    def parse_input(self, data: list[Any]) -> list[Any]:
        return [row.get("data") or row.get("body") for row in data]

    def format_output(self, data: Any) -> Any:
        return data
