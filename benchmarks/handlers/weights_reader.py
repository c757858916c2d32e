"""A model whose load really reads its weights: the residency benchmark's model
(benchmarks/residency.py), where a page-in must cost what reading a model's weights costs.

At load it reads its serialized file (the archive's ``serializedFile``, tens of MB of seeded
random bytes) into memory and sums it as unsigned 64-bit words (every byte read, from the page
cache or the disk); it keeps the file open, so that the benchmark can tell from outside which
model a process serves (``/proc/PID/fd``). Each request is answered with the model's name, that
sum (which tells its weights from every other model's) and the request's own body, so an answer
shows both the model it came from and the request it answers.

A module-level ``handle`` that works unchanged in batchserve and in TorchServe 0.12 (both call
``handle(None, context)`` once when the model loads).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

_loaded: dict[str, Any] = {}


def _load(context: Any) -> None:
    model = context.manifest["model"]
    path = Path(context.system_properties["model_dir"]) / model["serializedFile"]
    weights = np.fromfile(path, dtype=np.uint64)
    _loaded["name"] = model["modelName"]
    _loaded["checksum"] = f"{int(weights.sum(dtype=np.uint64)):016x}"
    _loaded["weights"] = weights  # resident, as a model's weights are
    _loaded["file"] = path.open("rb")  # the benchmark's sign of which model this process is


def handle(data: list[dict[str, Any]] | None, context: Any) -> list[str] | None:
    if not _loaded:
        _load(context)
    if data is None:  # the load-time call
        return None
    answers = []
    for row in data:
        body = row.get("body") if row.get("body") is not None else row.get("data")
        text = body.decode("utf-8", "replace") if isinstance(body, (bytes, bytearray)) \
            else str(body)
        answers.append(json.dumps({"model": _loaded["name"], "checksum": _loaded["checksum"],
                                   "echo": text}))
    return answers
