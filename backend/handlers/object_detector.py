"""TorchServe's ``object_detector``: per image, ``[{label: [x1, y1, x2, y2], "score": s}, ...]``.

For torchvision's detection models (Faster R-CNN, RetinaNet, SSD, ...), which take a list of
images of any sizes and return one ``{"boxes", "labels", "scores"}`` dict per image.
"""

from __future__ import annotations

from typing import Any

from torchvision import transforms

from backend.handlers.labels import LabelMap, label_of
from backend.handlers.vision import VisionHandler


class ObjectDetector(VisionHandler):
    """Keeps the detections whose score is at least ``threshold``."""

    threshold = 0.5
    # The model resizes and normalises by itself; boxes come back in the image's own pixels.
    image_processing = transforms.ToTensor()

    def preprocess(self, data: list[Any]) -> Any:
        # A list, not a stacked tensor: the images of one batch may differ in size.
        return [image.to(self.device) for image in data]

    def postprocess(self, outputs: Any) -> list[Any]:
        return labelled_detections(outputs, self.threshold, self.mapping)


def labelled_detections(outputs: Any, threshold: float, mapping: LabelMap | None) -> list[Any]:
    """Per image of a detection model's ``{"boxes", "labels", "scores"}`` dicts, the
    detections scoring at least ``threshold`` as ``{label: [x1, y1, x2, y2], "score": s}``."""
    results: list[Any] = []
    for detections in outputs:
        keep = detections["scores"] >= threshold
        boxes = detections["boxes"][keep].tolist()
        labels = detections["labels"][keep].tolist()
        scores = detections["scores"][keep].tolist()
        results.append([{label_of(mapping, label): box, "score": score}
                        for label, box, score in zip(labels, boxes, scores, strict=True)])
    return results
