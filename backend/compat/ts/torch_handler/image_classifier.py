"""``ts.torch_handler.image_classifier``: TorchServe's ImageClassifier.

ImageNet preprocessing (resize 256, centre crop 224, normalise), then per image the ``topk``
(5) most probable classes as ``{label: probability}``, labels from ``index_to_name.json``.
Unlike TorchServe's, a model with fewer than ``topk`` classes returns all of them instead of
failing in ``torch.topk``.
"""

from __future__ import annotations

from typing import Any

import torch

from backend.handlers.image_classifier import top_k_labels
from backend.handlers.vision import IMAGENET_TRANSFORM

from ..handler_utils.timer import timed
from ..utils.util import map_class_to_label
from .vision_handler import VisionHandler

__all__ = ["ImageClassifier", "map_class_to_label", "timed"]


class ImageClassifier(VisionHandler):
    """The model returns logits ``[N, classes]`` for a ``[N, 3, 224, 224]`` batch."""

    topk = 5
    image_processing = IMAGENET_TRANSFORM

    def set_max_result_classes(self, topk: int) -> None:
        self.topk = topk

    def get_max_result_classes(self) -> int:
        return self.topk

    @timed
    def postprocess(self, data: torch.Tensor) -> list[dict[str, Any]]:
        return top_k_labels(data, self.topk, self.mapping)
