"""The SageMaker image smoke test's user script, copied in as ``code/inference.py``.

Written as SageMaker users write theirs for the PyTorch toolkit: ``model_fn`` loads the weights
that sit beside ``code/`` (a ``torch.nn.Linear(4, 4)`` state_dict in ``model.pth``),
``input_fn`` reads a JSON or NPY body (a list of rows of 4 numbers), ``predict_fn`` runs the
model, ``output_fn`` answers JSON. Each model directory the smoke test writes carries other
weights, so an answer shows which model computed it.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

import numpy as np
import torch

WEIGHTS = "model.pth"


def model_fn(model_dir: str) -> torch.nn.Module:
    torch.set_num_threads(1)  # a 4x4 model needs no thread pool
    model = torch.nn.Linear(4, 4)
    state = torch.load(os.path.join(model_dir, WEIGHTS), map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    return model.eval()


def input_fn(request_body: Any, request_content_type: str) -> torch.Tensor:
    # The toolkit hands JSON over decoded to text and NPY as the body's bytes.
    if request_content_type == "application/json":
        return torch.tensor(json.loads(request_body), dtype=torch.float32)
    if request_content_type == "application/x-npy":
        array = np.load(io.BytesIO(request_body), allow_pickle=False)
        return torch.from_numpy(array).to(torch.float32)
    raise ValueError(f"unsupported content type: {request_content_type}")


def predict_fn(data: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        result: torch.Tensor = model(data)
    return result


def output_fn(prediction: torch.Tensor, accept: str) -> tuple[str, str]:
    return json.dumps(prediction.tolist()), "application/json"
