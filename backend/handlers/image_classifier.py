"""TorchServe's ``image_classifier``: ImageNet preprocessing, top-k ``{label: probability}``."""

from __future__ import annotations

from typing import Any

import torch

from backend.handlers.labels import LabelMap, label_of
from backend.handlers.vision import IMAGENET_TRANSFORM, VisionHandler


class ImageClassifier(VisionHandler):
    """Per image, the ``topk`` most probable classes, named through ``index_to_name.json``.

    The whole batch goes through the model as one ``[N, 3, 224, 224]`` tensor; the model
    returns logits ``[N, classes]``.
    """

    topk = 5
    image_processing = IMAGENET_TRANSFORM

    def set_max_result_classes(self, topk: int) -> None:
        self.topk = topk

    def get_max_result_classes(self) -> int:
        return self.topk

    def postprocess(self, outputs: Any) -> list[Any]:
        return top_k_labels(outputs, self.topk, self.mapping)


def top_k_labels(logits: Any, topk: int, mapping: LabelMap | None) -> list[dict[str, float]]:
    """Per row of ``[N, classes]`` logits: ``{label: probability}`` for the ``topk`` most
    probable classes (all of them when there are fewer), highest first."""
    probabilities = torch.softmax(logits.float(), dim=1)  # bf16/fp16 logits under amp
    k = min(topk, probabilities.shape[1])
    top_probabilities, top_classes = torch.topk(probabilities, k, dim=1)
    return [
        {label_of(mapping, c): p for c, p in zip(classes, probs, strict=True)}
        for classes, probs in zip(top_classes.tolist(), top_probabilities.tolist(), strict=True)
    ]
