"""The echo example: every request is answered with its own body (a module-level handler)."""

from __future__ import annotations

from typing import Any


def handle(data: list[dict[str, Any]] | None, context: Any) -> list[Any] | None:
    if data is None:  # TorchServe calls a function handler once with None at load time
        return None
    return [row.get("body", row.get("data", b"")) for row in data]
