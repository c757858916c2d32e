"""``ts.torch_handler.dali_image_classifier``: TorchServe's DALIImageClassifier: DALI
preprocessing, then per image the ``topk`` (5) most probable classes as
``{label: probability}``. Needs NVIDIA DALI at import, as TorchServe's module does."""

from __future__ import annotations

from typing import Any

import torch

from backend.handlers.image_classifier import top_k_labels

from ..utils.util import map_class_to_label
from .dali_handler import DALIHandler

__all__ = ["DALIHandler", "DALIImageClassifier", "map_class_to_label"]


class DALIImageClassifier(DALIHandler):
    """Top-k classes of each image."""

    topk = 5

    def set_max_result_classes(self, topk: int) -> None:
        self.topk = topk

    def get_max_result_classes(self) -> int:
        return self.topk

    def postprocess(self, data: torch.Tensor) -> list[dict[str, Any]]:
        return top_k_labels(data, self.topk, self.mapping)
