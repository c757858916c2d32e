"""Load the model of an extracted archive the ways TorchServe's BaseHandler does, sharing
the weights between the workers of a host.

* **eager**: the manifest's ``modelFile`` is a .py file defining exactly one ``nn.Module``
  subclass, built with no arguments; the ``serializedFile``, when there is one, is its state
  dict: a ``torch.save`` file (``weights_only=True``: loading weights never runs code from the
  file) or a ``.safetensors`` file. The module is built with its parameters on the meta device
  (nothing initialised, nothing allocated: ``backend.weights.empty``) and takes the state
  dict's tensors as its own, which are views of the file's pages (``backend.weights.files``):
  every worker of the model on the host reads the same page-cache copy.
* **TorchScript**: a ``serializedFile`` and no ``modelFile``: ``torch.jit.load``, then its
  tensors are pointed back at the archive's pages (``backend.weights.script``).
* **.pt2**: a ``serializedFile`` named ``*.pt2`` (a ``modelFile`` beside it is not used): a
  torch.export ExportedProgram or an AOTInductor package (``backend.weights.pt2``, which says
  which of them share their weights).

How the weights are held is the model config's ``handler.share_weights``
(``backend.weights.sharing``): shared pages (the default), a copy per worker (TorchServe's
way), or on CUDA one GPU copy per GPU through CUDA IPC (``backend.weights.cuda_ipc``).

What still copies, per process: a state dict in torch's legacy (not zip) format; a tensor
whose dtype or strides differ from the module's parameter (converted as ``load_state_dict``
converts); a model that cannot be built on the meta device or whose state-dict hooks copy
(built and loaded the ordinary way); and anything the handler or the model config does to
the weights after loading: ``channels_last`` (``.to(memory_format=...)``), ``.half()`` or
``.to(dtype)``, fusing, quantising, in-place edits (copy-on-write: only the pages written).
On CUDA the weights are copied to each worker's GPU memory unless ``share_weights:
cuda_ipc``. ONNX (onnxruntime reads the file into its own memory) and AOTInductor, the
``.so`` and the ``.pt2`` package (its runtime copies the constants into a blob of its own:
torch 2.14's ``model_base.h``, ``load_constants``) are not shared.
"""

from __future__ import annotations

import importlib
import logging
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from backend.errors import ModelLoadError, describe
from backend.imports import FileImportError, import_file
from backend.weights.cuda_ipc import LINGER_S, shared_state_dict
from backend.weights.empty import assign_state_dict, parameters_on_meta
from backend.weights.files import is_safetensors, is_torchscript_archive, read_state_dict
from backend.weights.pt2 import is_pt2, load_pt2
from backend.weights.script import map_onto_archive
from backend.weights.sharing import Sharing, read_sharing

__all__ = ["Sharing", "is_pt2", "is_safetensors", "is_torchscript_archive", "load_eager",
           "load_from_owner", "load_model", "load_pt2", "load_state_dict", "load_torchscript",
           "read_sharing"]

logger = logging.getLogger(__name__)


def load_model(model_dir: str | Path, manifest: Mapping[str, Any], device: torch.device,
               sharing: Sharing = Sharing.MMAP) -> torch.nn.Module:
    """The model the manifest describes, on ``device``. Raises ModelLoadError."""
    model_dir = Path(model_dir)
    model = manifest.get("model")
    entries: Mapping[str, Any] = model if isinstance(model, Mapping) else {}
    model_file = entries.get("modelFile")
    serialized_file = entries.get("serializedFile")

    weights = None
    if serialized_file:
        weights = model_dir / str(serialized_file)
        if not weights.is_file():
            raise ModelLoadError(
                f"the manifest's serializedFile {serialized_file!r} is not in {model_dir}"
            )
    if weights is not None and is_pt2(weights):
        if model_file:
            logger.info("%s is a whole program: the manifest's modelFile %s is not used",
                        weights.name, model_file)
        return load_pt2(weights, device, sharing)
    if model_file:
        return load_eager(model_dir / str(model_file), weights, device, sharing)
    if weights is None:
        raise ModelLoadError(
            "the manifest names neither a modelFile nor a serializedFile: there is no model "
            "to load (archive one with --serialized-file, and --model-file for an eager model)"
        )
    if is_safetensors(weights):
        raise ModelLoadError(
            f"{weights.name} holds weights only (safetensors): archive the model's class "
            f"with --model-file too"
        )
    return load_torchscript(weights, device, sharing)


def load_eager(model_file: Path, weights: Path | None, device: torch.device,
               sharing: Sharing = Sharing.MMAP) -> torch.nn.Module:
    """Build the one nn.Module class of ``model_file`` and give it the state dict
    ``weights``: shared as ``sharing`` says (see the module's docstring)."""
    model_class = _model_class(model_file)
    if weights is None:
        return _build(model_class, model_file).to(device)
    state: Mapping[str, Any]
    if sharing is Sharing.CUDA_IPC and device.type == "cuda":
        try:
            return _from_owner(model_class, model_file, weights, device, LINGER_S)
        except Exception as exc:  # the owner could not start, load or answer
            logger.warning("CUDA IPC weights unavailable (%s): this worker loads its own "
                           "copy", describe(exc))
    state = load_state_dict(weights, device, mmap=sharing is not Sharing.COPY)
    if sharing is Sharing.COPY:
        return _copied_into(_build(model_class, model_file), weights, state).to(device)
    return _assigned(model_class, model_file, weights, state, device, private_buffers=False)


def load_from_owner(model_file: Path, weights: Path, device: torch.device, *,
                    linger_s: float = LINGER_S) -> torch.nn.Module:
    """The model with its parameters in the memory of the owner of ``weights`` on ``device``
    (``backend.weights.cuda_ipc``: CUDA IPC on a GPU; the tests use it on the CPU, where it
    hands out shared memory) and buffers of its own. Raises OwnerError or OSError when no
    owner answers; ``linger_s``: how long an owner started now outlives its last worker."""
    return _from_owner(_model_class(model_file), model_file, weights, device, linger_s)


def _from_owner(model_class: type[torch.nn.Module], model_file: Path, weights: Path,
                device: torch.device, linger_s: float) -> torch.nn.Module:
    state = shared_state_dict(weights, device, linger_s=linger_s)
    return _assigned(model_class, model_file, weights, state, device, private_buffers=True)


def _assigned(model_class: type[torch.nn.Module], model_file: Path, weights: Path,
              state: Mapping[str, Any], device: torch.device, *,
              private_buffers: bool) -> torch.nn.Module:
    """The model built with empty parameters that then take ``state``'s tensors; built and
    loaded the ordinary way (a copy) when it cannot be built or loaded so."""
    try:
        with parameters_on_meta():
            model = model_class()
        copied = assign_state_dict(model, state, private_buffers=private_buffers)
    except Exception as exc:  # NotAssignable, or the model needs real parameters
        logger.info("%s cannot take the weights as they are (%s): building it with its own "
                    "copy", model_class.__name__, describe(exc))
        return _copied_into(_build(model_class, model_file), weights, state).to(device)
    if copied:
        logger.info("%d tensor(s) of %s converted to the model's dtype or layout (a copy "
                    "each)", copied, weights.name)
    return model.to(device)


def _copied_into(model: torch.nn.Module, weights: Path,
                 state: Mapping[str, Any]) -> torch.nn.Module:
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:  # missing, unexpected or mis-shaped keys
        raise ModelLoadError(
            f"{weights.name} does not fit {type(model).__name__}: {exc}"
        ) from exc
    return model


def _model_class(model_file: Path) -> type[torch.nn.Module]:
    if not model_file.is_file():
        raise ModelLoadError(
            f"the manifest's modelFile {model_file.name!r} is not in {model_file.parent}"
        )
    module = _import_model_file(model_file)
    classes = [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type)
        and issubclass(obj, torch.nn.Module)
        and obj.__module__ == module.__name__
    ]
    if len(classes) != 1:
        found = ", ".join(cls.__name__ for cls in classes) or "none"
        raise ModelLoadError(
            f"{model_file.name} must define exactly one torch.nn.Module subclass, found "
            f"{len(classes)} ({found})"
        )
    return classes[0]


def _build(model_class: type[torch.nn.Module], model_file: Path) -> torch.nn.Module:
    try:
        return model_class()
    except Exception as exc:
        raise ModelLoadError(
            f"cannot build {model_class.__name__}() from {model_file.name}: {describe(exc)}"
        ) from exc


def load_state_dict(path: Path, device: torch.device | None = None, *,
                    mmap: bool = True) -> Mapping[str, Any]:
    """A state dict saved with ``torch.save(model.state_dict(), path)`` or as safetensors,
    on the CPU (``device`` is where the model will run: the caller moves it), its tensors
    mapped from the file unless ``mmap`` is False. Raises ModelLoadError."""
    return read_state_dict(path, mmap=mmap)


def load_torchscript(path: Path, device: torch.device,
                     sharing: Sharing = Sharing.MMAP) -> torch.nn.Module:
    """A model saved with ``torch.jit.save``; on the CPU its tensors are then pointed at the
    archive's pages (``backend.weights.script``) unless ``sharing`` is COPY."""
    try:
        with warnings.catch_warnings():
            # NOTE: torch deprecates TorchScript in favour of torch.export, but archives made
            # for TorchServe hold TorchScript models and must keep loading; the warning is
            # meant for whoever writes new models, not for the server that runs old ones.
            warnings.filterwarnings("ignore", r".*torch\.jit\.load.*deprecated", FutureWarning)
            # torch.jit.load carries no annotations.
            model = torch.jit.load(str(path), map_location=device)  # type: ignore[no-untyped-call]
    except Exception as exc:
        raise ModelLoadError(
            f"cannot load {path.name} as TorchScript: {describe(exc)}; an eager model's state "
            f"dict also needs the manifest's modelFile (--model-file)"
        ) from exc
    if not isinstance(model, torch.nn.Module):  # pragma: no cover - jit.load's own contract
        raise ModelLoadError(f"{path.name} did not load as a module")
    if device.type == "cpu" and sharing is not Sharing.COPY:
        try:
            mapped, total = map_onto_archive(model, path)
        except Exception as exc:  # an archive layout this torch does not read: keep the copy
            logger.warning("cannot map %s's tensors onto its pages (%s): this worker keeps "
                           "its own copy", path.name, describe(exc))
        else:
            logger.info("%s: %d of %d storages mapped from the archive", path.name, mapped,
                        total)
    return model


def _import_model_file(path: Path) -> ModuleType:
    # Imported by path under a name no other module has (STYLE trap 22); the model directory
    # joins sys.path so that the model file can import the archive's other modules.
    directory = str(path.parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)
        importlib.invalidate_caches()
    try:
        return import_file(path, "model")
    except FileImportError as exc:
        raise ModelLoadError(f"cannot import the modelFile {path.name}: {exc}") from exc
