"""``ts.torch_handler.densenet_handler``: TorchServe's DenseNetHandler, a minimal handler
whose requests each carry a tensor saved with ``torch.save``; the batch's tensors are stacked,
run through the model, and the whole output tensor is the one result (TorchServe's shape:
give it ``batch_size`` 1).

Request tensors are loaded with ``weights_only=True``: a request cannot run code in the
worker (TorchServe's plain ``torch.load`` would unpickle anything a client sends).
"""

from __future__ import annotations

import inspect
import io
import logging
import os
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from backend.context import Context
from backend.errors import InvalidInput, ModelLoadError, describe
from backend.handlers.device import select_device
from backend.weights import load_eager, load_torchscript

logger = logging.getLogger(__name__)


class DenseNetHandler:
    """Loads an eager or TorchScript model; ``handle`` predicts on the stacked tensors."""

    def __init__(self) -> None:
        self.model: Any = None
        self.device: Any = None
        self.initialized = False
        self.context: Any = None
        self.manifest: Any = None
        self.map_location: str | None = None

    def initialize(self, context: Context) -> None:
        properties = context.system_properties
        self.device = select_device(properties.get("gpu_id"))
        self.map_location = self.device.type
        self.manifest = context.manifest
        model_dir = str(properties.get("model_dir"))
        model = self.manifest.get("model") or {}
        serialized = model.get("serializedFile")
        if not serialized or not os.path.isfile(os.path.join(model_dir, serialized)):
            raise ModelLoadError("Missing the model.pt file (the manifest's serializedFile)")
        path = os.path.join(model_dir, serialized)
        model_file = model.get("modelFile")
        if model_file:
            self.model = self._load_pickled_model(model_dir, model_file, path)
        else:
            self.model = self._load_torchscript_model(path)
        self.model.to(self.device)
        self.model.eval()
        self.initialized = True

    def _load_torchscript_model(self, model_pt_path: str) -> Any:
        return load_torchscript(Path(model_pt_path), self.device)

    def _load_pickled_model(self, model_dir: str, model_file: str, model_pt_path: str) -> Any:
        return load_eager(Path(model_dir) / model_file, Path(model_pt_path), self.device)

    def inference(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self.model(data.to(self.device), *args, **kwargs)

    def handle(self, data: list[Any], context: Context) -> list[Any]:
        start = time.time()
        self.context = context
        tensors = []
        for row in data:
            value = row.get("data") or row.get("body")
            try:
                tensors.append(torch.load(io.BytesIO(value), weights_only=True))
            except Exception as exc:
                raise InvalidInput(f"expected a tensor saved with torch.save: "
                                   f"{describe(exc)}") from None
        output = self.inference(torch.stack(tensors))
        context.metrics.add_time("HandlerTime", round((time.time() - start) * 1000, 2), None,
                                 "ms")
        return [output]


def list_classes_from_module(module: ModuleType, parent_class: type | None = None
                             ) -> list[type]:
    """The classes ``module`` itself defines, by name; only subclasses of ``parent_class``
    when one is given."""
    classes = [value for _, value in inspect.getmembers(module, inspect.isclass)
               if value.__module__ == module.__name__]
    if parent_class is None:
        return classes
    return [cls for cls in classes if issubclass(cls, parent_class)]
