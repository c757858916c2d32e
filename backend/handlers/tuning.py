"""A model's speed switches, read from its model-config.yaml.

* ``pt2`` exactly as TorchServe 0.12's BaseHandler reads it: ``pt2: {compile: {enable: true,
  backend: inductor, mode: reduce-overhead, options: {...}}}`` compiles with those keyword
  arguments; the older ``pt2: inductor`` (a backend name) or ``pt2: {backend: ..., mode: ...}``
  too; ``pt2: {export: ...}`` does not compile. An unknown backend, or a compilation that
  fails, leaves the model as it was (logged), as TorchServe does. A ``.pt2`` AOTInductor
  package is compiled already: ``pt2`` compile options are not applied to it (logged); an
  ExportedProgram is compiled as any model.
* batchserve's ``handler`` options: ``amp: bf16 | fp16`` (autocast around the forward pass),
  ``channels_last: true`` (the model and its image batches in channels-last memory),
  ``image_decode: tensor | pil`` (vision handlers, ``backend.handlers.images``),
  ``warmup: true | false | [batch sizes]``, and ``cuda_graphs: true | false`` and
  ``batch_buckets: [sizes]`` (``backend.handlers.graphs``: batches padded to a few sizes, each
  replayed as a CUDA graph on CUDA).
* On CUDA: ``torch.backends.cudnn.benchmark`` (convolution algorithms autotuned per input
  shape) and, on Ampere and newer, TF32 matmuls (``set_float32_matmul_precision("high")``), as
  TorchServe's BaseHandler sets at import.

The warm-up runs the model once per batch size it will see, before the worker says it has
loaded: compilation, autotuning and the graphs' capture never hit a client, and a
registration answers once they are done. With buckets (on CUDA by default: 1, 2, 4, ... up to
batch_size, and batch_size), every batch runs at a bucket's size, so the warm-up runs the
buckets (``warmup: [sizes]``: the buckets those sizes run in). Without, on the CPU, the model
sees every size and is warmed only when compiled (1 and batch_size).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from backend.errors import ModelLoadError, describe
from backend.handlers.buckets import buckets_run, read_buckets, read_cuda_graphs
from backend.weights.pt2 import Pt2Program
from model_archiver.pt2 import Pt2Kind

logger = logging.getLogger(__name__)

AMP_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
              "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class Tuning:
    """What model-config.yaml asks of a model's speed."""

    #: torch.compile keyword arguments; None: not compiled.
    compile_options: dict[str, Any] | None = None
    amp: torch.dtype | None = None
    channels_last: bool = False
    #: Vision handlers: "tensor" or "pil"; None: the handler's default.
    image_decode: str | None = None
    #: Batch sizes to warm up; None: the device's default (see ``warmup_sizes``).
    warmup: tuple[int, ...] | None = None
    #: ``warmup: false``.
    warmup_off: bool = False
    #: ``cuda_graphs`` (None: the handler's default on CUDA).
    cuda_graphs: bool | None = None
    #: ``batch_buckets`` (None: not set; on CUDA the default buckets of batch_size).
    batch_buckets: tuple[int, ...] | None = None
    handler_options: dict[str, Any] = field(default_factory=dict)


def pt2_compile_options(pt2: Any) -> dict[str, Any] | None:
    """TorchServe 0.12's reading of ``pt2``: torch.compile's keyword arguments, or None."""
    if isinstance(pt2, Mapping) and "compile" in pt2:
        options = pt2["compile"]
        if not isinstance(options, Mapping) or options.get("enable") is not True:
            return None
        kwargs = {key: value for key, value in options.items() if key != "enable"}
    elif isinstance(pt2, Mapping) and "export" in pt2:
        return None  # AOT export: a .so or .pt2 model, not a compiled nn.Module
    elif isinstance(pt2, str):
        kwargs = {"backend": pt2}
    elif isinstance(pt2, Mapping):
        logger.warning("pt2 given as torch.compile's arguments is deprecated in TorchServe; "
                       "use pt2: {compile: {enable: true, ...}}")
        kwargs = dict(pt2)
    else:
        raise ModelLoadError(f"model-config.yaml: pt2 must be a string or a mapping, got {pt2!r}")
    backend = kwargs.get("backend")
    if backend is not None and backend not in _compile_backends():
        logger.warning("pt2: torch.compile has no backend %r (it has %s); not compiling",
                       backend, ", ".join(_compile_backends()))
        return None
    return kwargs


def _compile_backends() -> list[str]:
    import torch._dynamo

    return list(torch._dynamo.list_backends(exclude_tags=()))


def read_tuning(config: Mapping[str, Any]) -> Tuning:
    """The tuning model-config.yaml asks for. Raises ModelLoadError for a bad value."""
    handler = config.get("handler") or {}
    if not isinstance(handler, Mapping):
        raise ModelLoadError("model-config.yaml: handler must be a mapping")
    amp = handler.get("amp")
    if amp not in (None, False) and str(amp).lower() not in AMP_DTYPES:
        raise ModelLoadError(f"model-config.yaml: handler.amp must be bf16 or fp16, got {amp!r}")
    image_decode = handler.get("image_decode")
    if image_decode is not None and image_decode not in ("tensor", "pil"):
        raise ModelLoadError("model-config.yaml: handler.image_decode must be tensor or pil, "
                             f"got {image_decode!r}")
    warmup = handler.get("warmup")
    sizes: tuple[int, ...] | None = None
    if isinstance(warmup, list):
        if not all(isinstance(size, int) and not isinstance(size, bool) and size > 0
                   for size in warmup):
            raise ModelLoadError("model-config.yaml: handler.warmup must be true, false or a "
                                 f"list of batch sizes, got {warmup!r}")
        sizes = tuple(warmup)
    elif warmup not in (None, True, False):
        raise ModelLoadError("model-config.yaml: handler.warmup must be true, false or a list "
                             f"of batch sizes, got {warmup!r}")
    return Tuning(
        compile_options=pt2_compile_options(config["pt2"]) if "pt2" in config else None,
        amp=AMP_DTYPES[str(amp).lower()] if amp not in (None, False) else None,
        channels_last=bool(handler.get("channels_last", False)),
        image_decode=image_decode,
        warmup=sizes,
        warmup_off=warmup is False,
        cuda_graphs=read_cuda_graphs(handler.get("cuda_graphs")),
        batch_buckets=read_buckets(handler.get("batch_buckets")),
        handler_options=dict(handler),
    )


def tune_model(model: torch.nn.Module, device: torch.device, tuning: Tuning) -> torch.nn.Module:
    """The model with the tuning applied (memory format, cuDNN, TF32, torch.compile)."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        if torch.cuda.get_device_capability(device) >= (8, 0):
            torch.set_float32_matmul_precision("high")
    if tuning.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if tuning.compile_options is not None and isinstance(model, Pt2Program) \
            and model.kind is Pt2Kind.AOTINDUCTOR:
        logger.info("pt2 compile options not applied: %s is compiled already", model.name)
    elif tuning.compile_options is not None:
        try:
            compiled = torch.compile(model, **tuning.compile_options)
        except Exception as exc:
            logger.warning("torch.compile(%s) failed, serving the model uncompiled: %s",
                           tuning.compile_options, describe(exc))
        else:
            logger.info("compiled the model with %s", tuning.compile_options)
            return compiled  # type: ignore[return-value]
    return model


#: torch.compile's modes that capture CUDA graphs themselves (cudagraph trees).
SELF_GRAPHED_MODES = ("reduce-overhead", "max-autotune")


def captured_elsewhere(tuning: Tuning, program: Pt2Program | None = None) -> str:
    """Why the server must not capture the model's graphs itself ("" when it may)."""
    if program is not None and program.kind is Pt2Kind.AOTINDUCTOR:
        return (f"{program.name} is an AOTInductor package, which launches its own compiled "
                f"kernels: not captured; the buckets run eagerly")
    mode = (tuning.compile_options or {}).get("mode")
    if mode in SELF_GRAPHED_MODES:
        return (f"pt2 compiles in mode {mode}, which captures CUDA graphs of its own "
                f"(cudagraph trees); the buckets run eagerly")
    return ""


@contextlib.contextmanager
def forward_context(device: torch.device, tuning: Tuning) -> Iterator[None]:
    """Where a forward pass runs: inference mode, and autocast when ``amp`` is set."""
    with torch.inference_mode():
        if tuning.amp is None:
            yield
        else:
            with torch.autocast(device.type, dtype=tuning.amp):
                yield


def warmup_sizes(tuning: Tuning, device: torch.device, batch_size: int,
                 buckets: tuple[int, ...] = ()) -> list[int]:
    """The batch sizes to run once at load (see the module's docstring): with ``buckets``
    (the ones batches run in), the buckets."""
    if tuning.warmup_off:
        return []
    if buckets:
        if tuning.warmup is not None:
            return buckets_run(tuning.warmup, buckets)
        return list(buckets) if device.type == "cuda" or tuning.compile_options is not None \
            else []
    if tuning.warmup is not None:
        return list(tuning.warmup)
    if device.type == "cuda" or tuning.compile_options is not None:
        return sorted({1, batch_size})
    return []


def warm_up(run: Callable[[int], object], sizes: list[int]) -> bool:
    """Run ``run(size)`` for each size; False when one failed (logged: the warm-up ends there
    and the model still serves, the request that meets the problem gets its error)."""
    for size in sizes:
        try:
            run(size)
        except Exception as exc:
            logger.warning("warm-up at batch size %d failed: %s", size, describe(exc))
            return False
    if sizes:
        logger.info("warmed up at batch sizes %s", sizes)
    return True
