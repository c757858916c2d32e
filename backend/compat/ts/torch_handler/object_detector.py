"""``ts.torch_handler.object_detector``: TorchServe's ObjectDetector.

For torchvision's detection models (Faster R-CNN, RetinaNet, SSD, ...): each image as a
``[3, H, W]`` tensor in its own size (the model resizes and normalises), and per image the
detections scoring at least ``threshold`` (0.5) as ``{label: [x1, y1, x2, y2], "score": s}``,
labels from ``index_to_name.json``. Where TorchServe's stacks the batch (so images of
different sizes fail together), ``preprocess`` here gives a list when their sizes differ,
which the detection models take as well.
"""

from __future__ import annotations

from typing import Any

import torch
from torchvision import transforms

from backend.context import Context
from backend.handlers.object_detector import labelled_detections

from ..utils.util import map_class_to_label
from .vision_handler import VisionHandler

__all__ = ["ObjectDetector", "VisionHandler", "map_class_to_label"]


class ObjectDetector(VisionHandler):
    """Keeps the detections whose score is at least ``threshold``."""

    image_processing = transforms.Compose([transforms.ToTensor()])
    threshold = 0.5

    def initialize(self, context: Context) -> None:
        super().initialize(context)

    def preprocess(self, data: list[Any]) -> Any:
        images: list[torch.Tensor] = [self._one(row) for row in data]
        if len({tuple(image.shape) for image in images}) > 1:
            return images
        return torch.stack(images)

    def _one(self, row: Any) -> torch.Tensor:
        image: torch.Tensor = VisionHandler.preprocess(self, [row])[0]
        return image

    def postprocess(self, data: Any) -> list[Any]:
        return labelled_detections(data, self.threshold, self.mapping)
