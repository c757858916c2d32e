"""TorchServe's ``image_segmenter``: the most probable class of every pixel, and its probability.

Per image the result is an ``[H][W][2]`` nested list of ``[class index, probability]`` (the
class as a float, as TorchServe returns it), for the 224x224 ImageNet crop of the image.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from backend.handlers.vision import IMAGENET_TRANSFORM, VisionHandler


class ImageSegmenter(VisionHandler):
    """For models returning ``[N, K, H, W]`` logits, or torchvision's ``{"out": logits}``."""

    image_processing = IMAGENET_TRANSFORM

    def postprocess(self, outputs: Any) -> list[Any]:
        return best_class_per_pixel(outputs)


def best_class_per_pixel(outputs: Any) -> list[Any]:
    """Per image of ``[N, K, H, W]`` logits (or ``{"out": logits}``), ``[H][W][2]``: each
    pixel's most probable class (as a float) and its probability."""
    logits = outputs["out"] if isinstance(outputs, Mapping) else outputs
    best = torch.softmax(logits, dim=1).max(dim=1)
    pixels = torch.stack([best.indices.to(best.values.dtype), best.values], dim=3)
    return list(pixels.tolist())
