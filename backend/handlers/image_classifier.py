"""TorchServe's ``image_classifier``: ImageNet preprocessing, top-k ``{label: probability}``;
explanations with Captum's IntegratedGradients, as TorchServe's vision handler gives them."""

from __future__ import annotations

from typing import Any

import torch

from backend.context import Context
from backend.errors import InvalidInput
from backend.handlers.base import map_valid
from backend.handlers.explain import explanation_target, integrated_gradients
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

    def explain_requests(self, data: list[Any], context: Context) -> list[Any]:
        """Per request, IntegratedGradients attributions of its ``target`` class (0 when it
        names none) over its preprocessed image: nested lists of the image tensor's shape
        (``[3, 224, 224]``). A bad image or target fails only its own request."""
        items: list[Any] = []
        for row, image in zip(data, self.load_images(data), strict=True):
            try:
                items.append(image if isinstance(image, InvalidInput)
                             else (image, explanation_target(row)))
            except InvalidInput as exc:
                items.append(exc)
        return map_valid(items, self._attributions, type(self).__name__)

    def _attributions(self, rows: list[tuple[torch.Tensor, int]]) -> list[Any]:
        inputs = self.preprocess([image for image, _ in rows])
        # The model as loaded: a compiled one would recompile for the steps' batch shapes.
        model = self._uncompiled or self.model
        assert model is not None, "initialize first"
        return list(integrated_gradients(model, inputs, [t for _, t in rows]).tolist())


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
