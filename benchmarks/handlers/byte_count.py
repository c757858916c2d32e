"""Ingestion only: each request is answered with the number of bytes of its body.

The upload benchmark (benchmarks/fronts.py) sends 64 KB JPEGs to it: nothing is decoded, so
what is measured is the server taking the bytes in (parsing, copying, queueing, passing them to
the worker) and answering small. A module-level ``handle`` that works unchanged in batchserve
and in TorchServe 0.12 (both call ``handle(None, context)`` once when the model loads).
"""

from __future__ import annotations

from typing import Any


def handle(data: list[dict[str, Any]] | None, context: Any) -> list[str] | None:
    if data is None:  # the load-time call: nothing to initialise
        return None
    return [str(len(row.get("body") or row.get("data") or b"")) for row in data]
