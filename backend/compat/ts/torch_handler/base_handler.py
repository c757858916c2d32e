"""``ts.torch_handler.base_handler``: TorchServe's BaseHandler on top of our own.

Custom handlers subclass it and override ``preprocess``/``inference``/``postprocess`` (or the
model loading hooks ``_load_pickled_model``/``_load_torchscript_model``), call
``super().initialize(context)``, and read ``self.model``, ``self.device``, ``self.manifest``,
``self.mapping``, ``self.context`` and ``self.initialized``. Device choice, weight loading and
label files come from ``backend.device``, ``backend.weights`` and ``backend.handlers.labels``.

The model config's ``pt2`` (torch.compile) is applied as TorchServe 0.12 applies it, and
batchserve's ``handler`` options ``amp`` and ``channels_last`` too (``backend.tuning``).
Explanations follow TorchServe: ``handle`` calls ``explain_handle`` when the request's
``explain`` header says ``True``, which calls ``get_insights``; here that answers 501 unless
the handler (or VisionHandler, with Captum) defines it. Deliberately missing, with the reason
given where a handler asks for it: ONNX, AOTInductor ``.so`` and ``.pt2`` models
(``ModelLoadError``), IPEX and OpenVINO (never applied), the torch profiler
(``ENABLE_TORCH_PROFILER`` is not read) and XLA/MPS/XPU devices (CUDA or CPU only).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from backend.context import Context
from backend.device import select_device
from backend.errors import ModelLoadError, Unsupported
from backend.handlers.base import BaseHandler as _BackendBaseHandler
from backend.handlers.explain import explanation_target, is_explanation
from backend.handlers.labels import INDEX_TO_NAME
from backend.tuning import forward_context, read_tuning
from backend.weights import load_eager, load_torchscript

from ..handler_utils.timer import timed
from ..utils.util import load_label_mapping

logger = logging.getLogger(__name__)

# Formats TorchServe's BaseHandler can load and ours cannot, by serializedFile suffix.
_UNSUPPORTED_FORMATS = {
    ".onnx": "ONNX models (onnxruntime)",
    ".so": "AOTInductor models (torch._export.aot_load)",
    ".pt2": "torch.export programs",
}


class BaseHandler(_BackendBaseHandler):
    """Loads the archive's model as TorchServe does; ``handle`` runs preprocess -> inference
    -> postprocess (or ``describe_handle``/``explain_handle`` when the request asks)."""

    def __init__(self) -> None:
        super().__init__()
        self.manifest: dict[str, Any] | None = None
        self.model_pt_path: str | None = None
        self.map_location: str | None = None
        self.model_yaml_config: dict[str, Any] = {}
        self.explain = False
        self.target = 0
        self.profiler_args: dict[str, Any] = {}

    def initialize(self, context: Context) -> None:
        """Pick the device, load the model the manifest names, read ``index_to_name.json``."""
        self.context = context
        self.model_yaml_config = context.model_yaml_config
        self.tuning = read_tuning(self.model_yaml_config)
        properties = context.system_properties
        self.device = select_device(properties.get("gpu_id"))
        self.map_location = self.device.type
        self.manifest = context.manifest

        model_dir = str(properties["model_dir"])
        model = self.manifest.get("model")
        entries: dict[str, Any] = model if isinstance(model, dict) else {}
        serialized_file = entries.get("serializedFile")
        self.model_pt_path = os.path.join(model_dir, serialized_file) if serialized_file else None
        model_file = entries.get("modelFile")

        if model_file:
            self.model = self._load_pickled_model(model_dir, model_file, self.model_pt_path)
            self.model.to(self.device)
        elif self.model_pt_path is None:
            raise ModelLoadError(
                "the manifest names neither a modelFile nor a serializedFile: there is no model "
                "to load (a handler that loads its own model should not call "
                "BaseHandler.initialize)"
            )
        else:
            suffix = Path(self.model_pt_path).suffix.lower()
            if suffix in _UNSUPPORTED_FORMATS:
                raise ModelLoadError(
                    f"{os.path.basename(self.model_pt_path)}: batchserve's ts.BaseHandler does "
                    f"not load {_UNSUPPORTED_FORMATS[suffix]}; load it in your own initialize"
                )
            self.model = self._load_torchscript_model(self.model_pt_path)
        self.set_model(self.model)
        self.mapping = load_label_mapping(os.path.join(model_dir, INDEX_TO_NAME))
        self.initialized = True

    def _load_pickled_model(
        self, model_dir: str, model_file: str, model_pt_path: str | None
    ) -> torch.nn.Module:
        """The one nn.Module class of ``model_file``, built with no arguments, with the state
        dict ``model_pt_path`` (when there is one) loaded into it."""
        weights = Path(model_pt_path) if model_pt_path else None
        if weights is not None and not weights.is_file():
            raise ModelLoadError(f"the manifest's serializedFile {weights.name!r} is missing")
        return load_eager(Path(model_dir) / model_file, weights, self.device)

    def _load_torchscript_model(self, model_pt_path: str) -> torch.nn.Module:
        """A TorchScript model saved with ``torch.jit.save``."""
        return load_torchscript(Path(model_pt_path), self.device)

    def _load_torch_export_aot_compile(self, model_so_path: str) -> Any:
        raise ModelLoadError(
            f"{os.path.basename(model_so_path)}: AOTInductor models are not supported here"
        )

    @timed
    def preprocess(self, data: Any) -> Any:
        return super().preprocess(data)

    @timed
    def inference(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__} has no model: call initialize first")
        with forward_context(self.device, self.tuning):
            if isinstance(data, torch.Tensor):
                data = data.to(self.device)
            return self.model(data, *args, **kwargs)

    @timed
    def postprocess(self, data: Any) -> Any:
        return super().postprocess(data)

    def handle(self, data: list[Any], context: Context) -> Any:
        """One batch in, one result per request out; records ``HandlerTime``."""
        start = time.perf_counter()
        self.context = context
        if self._is_describe():
            output = [self.describe_handle()]
        else:
            inputs = self.preprocess(data)
            if self._is_explain():
                output = self.explain_handle(inputs, data)
            else:
                output = self.postprocess(self.inference(inputs))
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        context.metrics.add_time("HandlerTime", round(elapsed_ms, 2), None, "ms")
        return output

    def explain_handle(self, data_preprocess: Any, raw_data: list[Any]) -> Any:
        """``get_insights(preprocessed batch, first request's input, its target)``, as
        TorchServe calls it; the target is a class index (0 when the request names none)."""
        inputs: Any = None
        row = raw_data[0] if raw_data else None
        if isinstance(row, dict):
            inputs = row.get("data") or row.get("body")
        return self.get_insights(data_preprocess, inputs, explanation_target(row))

    def get_insights(self, tensor_data: Any, raw_data: Any, target: Any = 0) -> Any:
        """Override to explain a prediction (one explanation per request)."""
        raise Unsupported(
            f"{type(self).__name__} cannot explain its predictions: it defines no "
            f"get_insights (TorchServe's explanation hook)"
        )

    def describe_handle(self) -> Any:
        """Override to answer ``describe`` requests with custom metadata."""
        return None

    def get_device(self) -> torch.device:
        return self.device

    def _is_explain(self) -> bool:
        if is_explanation(self.context):
            self.explain = True
            return True
        return False

    def _is_describe(self) -> bool:
        return self._first_request_header("describe") == "True"

    def _first_request_header(self, name: str) -> str | None:
        if self.context is None or not self.context.request_processor:
            return None
        return self.context.get_request_header(0, name)
