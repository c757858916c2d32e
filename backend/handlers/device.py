"""Pick the torch device a worker runs its model on."""

from __future__ import annotations

import torch


def select_device(gpu_id: int | None) -> torch.device:
    """``cuda:<gpu_id>`` when CUDA is available and the frontend assigned a GPU, else the CPU."""
    if gpu_id is not None and torch.cuda.is_available():
        return torch.device("cuda", gpu_id)
    return torch.device("cpu")
