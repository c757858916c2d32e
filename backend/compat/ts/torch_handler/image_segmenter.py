"""``ts.torch_handler.image_segmenter``: TorchServe's ImageSegmenter.

ImageNet preprocessing (resize 256, centre crop 224, normalise), then per image an
``[H][W][2]`` nested list of each pixel's most probable class (as a float) and its
probability, for models returning ``{"out": [N, K, H, W] logits}`` (torchvision's
segmentation models) or the logits themselves.
"""

from __future__ import annotations

from typing import Any

from backend.handlers.image_segmenter import best_class_per_pixel
from backend.handlers.vision import IMAGENET_TRANSFORM

from .vision_handler import VisionHandler

__all__ = ["ImageSegmenter", "VisionHandler"]


class ImageSegmenter(VisionHandler):
    """The most probable class of every pixel of a ``[N, 3, 224, 224]`` batch."""

    image_processing = IMAGENET_TRANSFORM

    def postprocess(self, data: Any) -> list[Any]:
        return best_class_per_pixel(data)
