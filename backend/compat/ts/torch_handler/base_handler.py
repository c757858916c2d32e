"""``ts.torch_handler.base_handler``: TorchServe's BaseHandler on top of our own.

Custom handlers subclass it and override ``preprocess``/``inference``/``postprocess`` (or the
model loading hooks ``_load_pickled_model``/``_load_torchscript_model``), call
``super().initialize(context)``, and read ``self.model``, ``self.device``, ``self.manifest``,
``self.mapping``, ``self.context`` and ``self.initialized``. Device choice, weight loading and
label files come from ``backend.handlers.device``, ``backend.weights`` and
``backend.handlers.labels``.
A subclass whose ``__init__`` does not call ``super().__init__()`` (TorchServe's
micro-batching example) still works: every attribute has a class-level default.

Models: eager (``modelFile`` + state dict), TorchScript, ONNX (``.onnx``, when onnxruntime
is installed: ``self.model`` is then an InferenceSession, as in TorchServe), AOTInductor
``.so`` (with ``pt2: {export: {aot_compile: true}}``) and ``.pt2`` programs, a torch.export
ExportedProgram or an AOTInductor package (``backend.weights.pt2``; a ``modelFile`` beside it
is not used, ``pt2: {export: {aot_compile: true}}`` may be there or not). ``self.model`` is
then a module calling the program; ``inference`` runs it in batches its batch dimension takes
(split or padded), a handler calling ``self.model`` itself gets the program as it is. Eager,
TorchScript and ExportedProgram weights are shared by the workers of a host (memory-mapped:
``backend.weights``, docs/weights.md; the model config's ``handler.share_weights``). The
model config's ``pt2`` (torch.compile) is applied as TorchServe 0.12 applies it, and
batchserve's ``handler`` options ``amp`` and ``channels_last`` too
(``backend.handlers.tuning``). ``ENABLE_TORCH_PROFILER`` runs each batch under torch.profiler
as TorchServe does (traces in /tmp/pytorch_profiler/<model>). Explanations follow TorchServe:
``handle`` calls ``explain_handle`` when the request's ``explain`` header says ``True``, which
calls ``get_insights``; here that answers 501 unless the handler (or VisionHandler, with
Captum) defines it. Deliberately missing, with the reason given where a handler asks for it:
IPEX and OpenVINO (never applied: ``IPEX_AVAILABLE`` is False) and XLA/MPS/XPU devices (CUDA
or CPU only: ``XLA_AVAILABLE`` is False).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from backend.context import EXPLAIN_HEADER, Context
from backend.errors import ModelLoadError, Unsupported
from backend.handlers.base import BaseHandler as _BackendBaseHandler
from backend.handlers.device import select_device
from backend.handlers.explain import explanation_target
from backend.handlers.labels import INDEX_TO_NAME
from backend.handlers.tuning import Tuning, forward_context, read_tuning
from backend.weights import is_pt2, load_eager, load_pt2, load_torchscript, read_sharing

from ..handler_utils.timer import timed
from ..utils.util import check_valid_pt2_backend, list_classes_from_module, load_label_mapping

__all__ = ["IPEX_AVAILABLE", "ONNX_AVAILABLE", "PROFILER_AVAILABLE", "PT2_AVAILABLE",
           "PT230_AVAILABLE", "XLA_AVAILABLE", "BaseHandler", "check_valid_pt2_backend",
           "list_classes_from_module", "load_label_mapping", "setup_ort_session", "timed"]

logger = logging.getLogger(__name__)


def _torch_at_least(major: int, minor: int, patch: int = 0) -> bool:
    numbers = []
    for part in torch.__version__.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        numbers.append(int(digits or 0))
    return tuple(numbers) >= (major, minor, patch)


#: torch.profiler (every torch this runs with has it).
PROFILER_AVAILABLE = True
#: torch.compile (torch >= 2.0; batchserve needs 2.2).
PT2_AVAILABLE = True
#: torch._export.aot_load for AOTInductor .so models (torch > 2.2.2).
PT230_AVAILABLE = _torch_at_least(2, 3)
#: Whether ONNX models can load (onnxruntime and psutil installed); checked, not imported.
ONNX_AVAILABLE = all(importlib.util.find_spec(name) is not None
                     for name in ("onnxruntime", "psutil"))
#: XLA devices are never used here (CUDA or CPU).
XLA_AVAILABLE = False
#: Intel's extension is never applied here (TS_IPEX_ENABLE is not read).
IPEX_AVAILABLE = False

_PROFILER_TRACES = "/tmp/pytorch_profiler"


def setup_ort_session(model_pt_path: str, map_location: str) -> Any:
    """An onnxruntime InferenceSession for the ``.onnx`` file, on CUDA (falling back to the
    CPU) when ``map_location`` is "cuda", with as many threads as the machine has cores."""
    import psutil

    onnxruntime = importlib.import_module("onnxruntime")  # optional: no stubs to check

    providers = (["CUDAExecutionProvider", "CPUExecutionProvider"] if map_location == "cuda"
                 else ["CPUExecutionProvider"])
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = psutil.cpu_count(logical=True)
    return onnxruntime.InferenceSession(model_pt_path, providers=providers,
                                        sess_options=options)


class BaseHandler(_BackendBaseHandler):
    """Loads the archive's model as TorchServe does; ``handle`` runs preprocess -> inference
    -> postprocess (or ``describe_handle``/``explain_handle`` when the request asks)."""

    # Class-level defaults: TorchServe's own attributes (set again per instance by
    # __init__) and ours, for subclasses that skip super().__init__().
    model: Any = None
    mapping: Any = None
    device: Any = None
    initialized = False
    context: Any = None
    model_pt_path: str | None = None
    manifest: dict[str, Any] | None = None
    map_location: str | None = None
    explain = False
    target = 0
    model_yaml_config: dict[str, Any] = {}  # replaced by initialize, never mutated
    tuning = Tuning()
    _uncompiled: torch.nn.Module | None = None
    # On CUDA, ``inference`` replays a CUDA graph per padded batch bucket, captured at each
    # bucket's first batch (``backend.handlers.graphs``; ``cuda_graphs: false`` opts out).
    graphs_by_default = True

    def __init__(self) -> None:
        super().__init__()
        self.model = None
        self.device = None
        self.manifest = None
        self.model_pt_path = None
        self.map_location = None
        self.model_yaml_config = {}
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

        if self.model_pt_path is not None and is_pt2(Path(self.model_pt_path)):
            self._load_serialized(self.model_pt_path)
        elif model_file:
            self.model = self._load_pickled_model(model_dir, model_file, self.model_pt_path)
            self.model.to(self.device)
            self.set_model(self.model)
        elif self.model_pt_path is None:
            raise ModelLoadError(
                "the manifest names neither a modelFile nor a serializedFile: there is no model "
                "to load (a handler that loads its own model should not call "
                "BaseHandler.initialize)"
            )
        else:
            self._load_serialized(self.model_pt_path)
        self.mapping = load_label_mapping(os.path.join(model_dir, INDEX_TO_NAME))
        self.start_runner(context)
        self.initialized = True

    def _load_serialized(self, path: str) -> None:
        suffix = Path(path).suffix.lower()
        name = os.path.basename(path)
        if suffix == ".pt2":
            self.set_model(load_pt2(Path(path), self.device,
                                    read_sharing(getattr(self, "model_yaml_config", None))))
        elif suffix == ".onnx":
            if not ONNX_AVAILABLE:
                raise ModelLoadError(f"{name}: an ONNX model needs onnxruntime (pip install "
                                     f"onnxruntime, or onnxruntime-gpu)")
            self.model = setup_ort_session(path, str(self.map_location))
            logger.info("Succesfully setup ort session")
        elif suffix == ".so":
            if not (self._use_torch_export_aot_compile() and PT230_AVAILABLE):
                raise ModelLoadError(f"{name}: an AOTInductor model needs model-config.yaml's "
                                     f"pt2: {{export: {{aot_compile: true}}}}")
            if self.device.type == "cuda":  # aot_load has no device id: it uses the current
                torch.cuda.set_device(self.device)
            self.model = self._load_torch_export_aot_compile(path)
        else:
            self.set_model(self._load_torchscript_model(path))

    def _load_pickled_model(
        self, model_dir: str, model_file: str, model_pt_path: str | None
    ) -> torch.nn.Module:
        """The one nn.Module class of ``model_file``, built with no arguments, with the state
        dict ``model_pt_path`` (when there is one) loaded into it."""
        weights = Path(model_pt_path) if model_pt_path else None
        if weights is not None and not weights.is_file():
            raise ModelLoadError(f"the manifest's serializedFile {weights.name!r} is missing")
        return load_eager(Path(model_dir) / model_file, weights, self.device,
                          read_sharing(getattr(self, "model_yaml_config", None)))

    def _load_torchscript_model(self, model_pt_path: str) -> torch.nn.Module:
        """A TorchScript model saved with ``torch.jit.save``."""
        return load_torchscript(Path(model_pt_path), self.device,
                                read_sharing(getattr(self, "model_yaml_config", None)))

    def _load_torch_export_aot_compile(self, model_so_path: str) -> Any:
        """An AOTInductor-compiled model (``torch._export.aot_compile``'s ``.so``), as a
        callable."""
        import torch._export

        return torch._export.aot_load(model_so_path, str(self.map_location))

    def _use_torch_export_aot_compile(self) -> bool:
        """Whether model-config.yaml says ``pt2: {export: {aot_compile: true}}``."""
        pt2 = (getattr(self, "model_yaml_config", None) or {}).get("pt2")
        export = pt2.get("export") if isinstance(pt2, dict) else None
        return isinstance(export, dict) and bool(export.get("aot_compile"))

    @timed
    def preprocess(self, data: Any) -> Any:
        return torch.as_tensor(data, device=self.device)

    @timed
    def inference(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__} has no model: call initialize first")
        with forward_context(self.device, self.tuning):
            if isinstance(data, torch.Tensor):
                data = data.to(self.device)
            if self.runner is not None and not args and not kwargs:
                return self.runner(data)  # in batch buckets (on CUDA: CUDA graphs)
            return self.model(data, *args, **kwargs)

    @timed
    def postprocess(self, data: Any) -> Any:
        return data.tolist()

    def handle(self, data: list[Any], context: Context) -> Any:
        """One batch in, one result per request out; records ``HandlerTime``."""
        start = time.perf_counter()
        self.context = context
        if os.environ.get("ENABLE_TORCH_PROFILER"):
            if self.manifest is None:
                self.manifest = context.manifest
            output, _ = self._infer_with_profiler(data=data)
        elif self._is_describe():
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

    def _infer_with_profiler(self, data: Any) -> tuple[Any, Any]:
        """The batch under torch.profiler, each step recorded by name; the output and the
        profiler. ``self.profiler_args`` (torch.profiler.profile's arguments) default to CPU
        and CUDA activities with shapes, traces written for TensorBoard under
        /tmp/pytorch_profiler/<model name>."""
        from torch.profiler import (
            ProfilerActivity,
            profile,
            record_function,
            tensorboard_trace_handler,
        )

        args = self.__dict__.setdefault("profiler_args", {})
        if not args:
            args["activities"] = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            args["record_shapes"] = True
        if "on_trace_ready" not in args:
            model = (self.manifest or {}).get("model") or {}
            path = os.path.join(_PROFILER_TRACES, str(model.get("modelName", "")))
            args["on_trace_ready"] = tensorboard_trace_handler(path)
            logger.info("Saving chrome trace to : %s", path)
        with profile(**args) as prof:
            with record_function("preprocess"):
                inputs = self.preprocess(data)
            if self._is_explain():
                with record_function("explain"):
                    output = self.explain_handle(inputs, data)
            else:
                with record_function("inference"):
                    output = self.inference(inputs)
                with record_function("postprocess"):
                    output = self.postprocess(output)
        logger.info(prof.key_averages().table(sort_by="cpu_time_total", row_limit=10))
        return output, prof

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

    def get_device(self) -> Any:
        return self.device

    def _is_explain(self) -> bool:
        if self._first_request_header(EXPLAIN_HEADER) == "True":
            self.explain = True
            return True
        return False

    def _is_describe(self) -> bool:
        return bool(self._first_request_header("describe") == "True")

    def _first_request_header(self, name: str) -> Any:
        """The batch's first request's header ``name``; None outside a batch. Any context
        with ``get_request_header`` will do (TorchServe's tests pass a MockContext)."""
        context = self.context
        if context is None or getattr(context, "request_processor", None) == []:
            return None
        return context.get_request_header(0, name)
