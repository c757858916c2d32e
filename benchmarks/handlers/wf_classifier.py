"""The model node of the workflow benchmark: a small MLP classifier over 64 features.

Its weights are the archive's serialized file (a ``state_dict`` that ``benchmarks.workflow``
writes with seeded random weights), loaded once per worker. A request's input is the list of
64 floats that the workflow's ``pre`` function hands on (JSON, as bytes or text, or already
decoded), or an object with a ``features`` list (the model called directly). Each answer is
the list of the 10 class probabilities, rounded to 6 places.

A module-level ``handle`` that works unchanged in batchserve and in TorchServe 0.12 (both call
``handle(None, context)`` once when the model loads).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

FEATURES, HIDDEN, CLASSES = 64, 256, 10

_model: torch.nn.Module | None = None


def build() -> torch.nn.Module:
    """The architecture; ``benchmarks.workflow`` saves a seeded random ``state_dict`` of it."""
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES))


def _load(context: Any) -> torch.nn.Module:
    torch.set_num_threads(1)  # one core per worker: the machine's cores are shared
    model_dir = context.system_properties.get("model_dir") or "."
    serialized = context.manifest["model"]["serializedFile"]
    model = build()
    model.load_state_dict(torch.load(os.path.join(model_dir, serialized), weights_only=True))
    return model.eval()


def _features(row: dict[str, Any]) -> list[float]:
    value = row.get("body") if row.get("body") is not None else row.get("data")
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode("utf-8")
    if isinstance(value, str):
        value = json.loads(value)
    if isinstance(value, dict):
        value = value["features"]
    if not isinstance(value, list) or len(value) != FEATURES:
        raise ValueError(f"expected {FEATURES} features")
    return [float(x) for x in value]


def handle(data: list[dict[str, Any]] | None, context: Any) -> list[list[float]] | None:
    global _model
    if _model is None:
        _model = _load(context)
    if data is None:
        return None
    batch = torch.tensor([_features(row) for row in data], dtype=torch.float32)
    with torch.inference_mode():
        probabilities = torch.softmax(_model(batch), dim=1)
    return [[round(p, 6) for p in row] for row in probabilities.tolist()]
