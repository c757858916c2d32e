"""``ts.context``: our worker's Context already has TorchServe's shape, so it is re-exported."""

from __future__ import annotations

from backend.context import Context, RequestProcessor

__all__ = ["Context", "RequestProcessor"]
