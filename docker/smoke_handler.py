"""The image smoke test's model: a real torch model, ``y = 2 * x + 1`` on vectors of 4 floats.

A ``torch.nn.Linear(4, 4)`` (weight ``2 * I``, bias ``1``) so the smoke test shows the image's
torch at work, not only the server. One handler answers every API the smoke test calls: a row
is ``{"INPUT0": [4 floats]}`` from the Open Inference Protocol (v2 REST and gRPC, answered
``{"OUTPUT0": [...]}``), a body that is one vector (a KServe v1 instance, or TorchServe's
/predictions with a JSON list), or the vector itself, as TorchServe's kserve envelope passes a
v1 instance; answered with the list.
"""

from __future__ import annotations

import json
from typing import Any

import torch


def _vector(row: Any) -> Any:
    if isinstance(row, list):
        return row
    if "INPUT0" in row:
        return row["INPUT0"]
    value = row.get("body", row.get("data"))
    return json.loads(value) if isinstance(value, (bytes, bytearray)) else value


class AffineHandler:
    def __init__(self) -> None:
        self.model: torch.nn.Linear | None = None

    def initialize(self, context: Any) -> None:
        torch.set_num_threads(1)  # a 4x4 model needs no thread pool
        model = torch.nn.Linear(4, 4)
        with torch.no_grad():
            model.weight.copy_(2 * torch.eye(4))
            model.bias.fill_(1.0)
        self.model = model.eval()

    def handle(self, data: list[Any] | None, context: Any) -> list[Any] | None:
        if data is None or self.model is None:
            return None
        batch = torch.tensor([_vector(row) for row in data], dtype=torch.float32)
        with torch.inference_mode():
            result = self.model(batch).tolist()
        return [{"OUTPUT0": out} if isinstance(row, dict) and "INPUT0" in row else out
                for row, out in zip(data, result, strict=True)]
