"""Built-in handlers, addressed in a manifest by bare name (TorchServe's ``image_classifier`` …).

The table maps a name to ``"module:Class"``; the module is imported only when a model asks for
it, so a worker serving a custom handler never pays for torch or torchvision.
"""

from __future__ import annotations

import importlib

BUILTIN_HANDLERS: dict[str, str] = {
    "image_classifier": "backend.handlers.image_classifier:ImageClassifier",
    "image_segmenter": "backend.handlers.image_segmenter:ImageSegmenter",
    "object_detector": "backend.handlers.object_detector:ObjectDetector",
    "text_classifier": "backend.handlers.text_classifier:TextClassifier",
}


def builtin_handler(name: str) -> type | None:
    """The class registered under ``name``, imported now; None when no built-in has that name."""
    target = BUILTIN_HANDLERS.get(name)
    if target is None:
        return None
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not isinstance(cls, type):
        raise TypeError(f"built-in handler {name!r} points at {target!r}, which is not a class")
    return cls
