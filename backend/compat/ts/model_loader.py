"""``ts.model_loader``: TorchServe's way from a model directory and a handler name to a
``ts.service.Service``.

The handler is a module on ``sys.path`` (``"handler"``, ``"handler.py"``,
``"path/to/handler.py:function"``; the model directory is put on ``sys.path`` first, as
TorchServe's worker runs in it), or else one of ``ts.torch_handler``'s (``"image_classifier"``).
A module-level function is the entry point (called once with no data to initialise), or the
module's one class, instantiated, whose ``initialize`` and ``handle`` are used. An envelope
(``"json"``, ``"kserve"``, ...) from ``ts.torch_handler.request_envelope`` wraps the entry
point. batchserve's worker resolves handlers with ``backend.service.loader`` instead, which also
finds a class among several and imports the file by path.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
from .service import Service
from .utils.util import list_classes_from_module

__all__ = ["MetricsCacheYamlImpl", "ModelLoader", "ModelLoaderFactory", "Service", "TsModelLoader",
           "list_classes_from_module"]

logger = logging.getLogger(__name__)

_Entry = Callable[[Any, Any], Any]


class ModelLoaderFactory:
    """Hands out the model loader (there is one kind)."""

    @staticmethod
    def get_model_loader() -> TsModelLoader:
        return TsModelLoader()


class ModelLoader:
    """Loads a model from its directory (not an ABC, as in TorchServe)."""

    def load(self, model_name: str, model_dir: str, handler: str | None = None,
             gpu_id: int | None = None, batch_size: int | None = None,
             envelope: str | None = None, limit_max_image_pixels: bool | None = True) -> Any:
        """The loaded model's service (override it)."""
        raise NotImplementedError


class TsModelLoader(ModelLoader):
    """TorchServe's model loader."""

    def load(self, model_name: str, model_dir: str, handler: str | None = None,
             gpu_id: int | None = None, batch_size: int | None = None,
             envelope: str | None = None, limit_max_image_pixels: bool | None = True,
             metrics_cache: MetricsCacheYamlImpl | None = None) -> Service:
        """A Service for the model in ``model_dir`` with its handler initialised.

        ``metrics_cache`` becomes ``context.metrics`` (batchserve's when None). Raises
        ValueError when the handler cannot be found or has no single entry point.
        """
        if not handler:
            raise ValueError(f"model {model_name}: no handler given")
        if metrics_cache is not None:  # TorchServe tags the load's metrics with an id
            metrics_cache.set_request_ids(str(uuid.uuid4()))
        manifest = None
        manifest_file = os.path.join(model_dir, "MAR-INF", "MANIFEST.json")
        if os.path.exists(manifest_file):
            with open(manifest_file, encoding="utf-8") as file:
                manifest = json.load(file)
        if model_dir not in sys.path:
            sys.path.insert(0, model_dir)
            importlib.invalidate_caches()
        function_name: str | None = None
        try:
            module, function_name = self._load_handler_file(handler)
        except ImportError:
            module = self._load_default_handler(handler)
        function_name = function_name or "handle"
        if hasattr(module, function_name):
            entry_point, initialize = self._get_function_entry_point(module, function_name)
        else:
            entry_point, initialize = self._get_class_entry_point(module)
        if envelope:
            envelope_class = self._load_default_envelope(envelope)
            entry_point = envelope_class(entry_point).handle
        service = Service(model_name, model_dir, manifest, entry_point, gpu_id,
                          batch_size or 1, bool(limit_max_image_pixels), metrics_cache)
        initialize(service.context)
        return service

    def _load_handler_file(self, handler: str) -> tuple[ModuleType, str | None]:
        """``"dir/handler.py:function"`` -> (the module ``handler``, ``"function"``)."""
        module_part, _, function_name = handler.partition(":")
        module_name = module_part.removesuffix(".py").rsplit("/", 1)[-1]
        return importlib.import_module(module_name), function_name or None

    def _load_default_handler(self, handler: str) -> ModuleType:
        """``ts.torch_handler.<handler>``; ValueError when there is none of that name."""
        try:
            return importlib.import_module(f".{handler}", _package("torch_handler"))
        except ImportError as exc:
            raise ValueError(f"Unable to load module {handler}, make sure it is added to python "
                             f"path ({exc})") from exc

    def _load_default_envelope(self, envelope: str) -> type:
        """The class of ``ts.torch_handler.request_envelope.<envelope>``."""
        module = importlib.import_module(f".{envelope}", _package("torch_handler.request_envelope"))
        classes = list_classes_from_module(module)
        if not classes:
            raise ValueError(f"envelope module {envelope} defines no class")
        return classes[0]

    def _get_function_entry_point(self, module: ModuleType, function_name: str
                                  ) -> tuple[_Entry, Callable[[Any], Any]]:
        entry_point = getattr(module, function_name)
        return entry_point, lambda context: entry_point(None, context)

    def _get_class_entry_point(self, module: ModuleType) -> tuple[_Entry, Callable[[Any], Any]]:
        classes = list_classes_from_module(module)
        if len(classes) != 1:
            raise ValueError(f"Expected only one class in custom service code or a function "
                             f"entry point {classes}")
        service = classes[0]()
        if not hasattr(service, "handle"):
            raise ValueError(f"Expect handle method in class {classes[0]}")
        return service.handle, service.initialize


def _package(relative: str) -> str:
    """A subpackage of this ``ts`` (``ts.x``, or ``backend.compat.ts.x`` when imported so)."""
    return f"{__name__.rpartition('.')[0]}.{relative}"
