"""Load the model of an extracted archive the two ways TorchServe's BaseHandler does.

* **eager**: the manifest's ``modelFile`` is a .py file defining exactly one ``nn.Module``
  subclass, built with no arguments; the ``serializedFile``, when there is one, is its state
  dict (``torch.load(weights_only=True)``: loading weights never runs code from the file).
* **TorchScript**: a ``serializedFile`` and no ``modelFile``: ``torch.jit.load``.

Other formats (ONNX, AOTInductor ``.so``, ``torch.export`` ``.pt2``) are not handled here;
each would get a module of its own, imported only when a manifest asks for it.
"""

from __future__ import annotations

import importlib
import sys
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from backend.errors import ModelLoadError, describe
from backend.imports import FileImportError, import_file


def load_model(
    model_dir: str | Path, manifest: Mapping[str, Any], device: torch.device
) -> torch.nn.Module:
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
    if model_file:
        return load_eager(model_dir / str(model_file), weights, device)
    if weights is None:
        raise ModelLoadError(
            "the manifest names neither a modelFile nor a serializedFile: there is no model "
            "to load (archive one with --serialized-file, and --model-file for an eager model)"
        )
    return load_torchscript(weights, device)


def load_eager(model_file: Path, weights: Path | None, device: torch.device) -> torch.nn.Module:
    """Build the one nn.Module class of ``model_file`` and load the state dict ``weights``."""
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
    model_class = classes[0]
    try:
        model = model_class()
    except Exception as exc:
        raise ModelLoadError(
            f"cannot build {model_class.__name__}() from {model_file.name}: {describe(exc)}"
        ) from exc
    if weights is not None:
        state_dict = load_state_dict(weights, device)
        try:
            model.load_state_dict(state_dict)
        except RuntimeError as exc:  # missing, unexpected or mis-shaped keys
            raise ModelLoadError(
                f"{weights.name} does not fit {model_class.__name__}: {exc}"
            ) from exc
    return model.to(device)


def load_state_dict(path: Path, device: torch.device) -> Mapping[str, Any]:
    """A state dict saved with ``torch.save(model.state_dict(), path)``."""
    if is_torchscript_archive(path):
        raise ModelLoadError(
            f"{path.name} is a TorchScript archive, not a state dict: archive it without "
            f"--model-file to serve it as TorchScript"
        )
    try:
        state_dict = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # UnpicklingError, RuntimeError from the zip reader, ...
        raise ModelLoadError(
            f"cannot load the state dict {path.name} with torch.load(weights_only=True): "
            f"{describe(exc)}; it must hold tensors only, as torch.save(model.state_dict()) "
            f"writes"
        ) from exc
    if not isinstance(state_dict, Mapping):
        raise ModelLoadError(
            f"{path.name} holds a {type(state_dict).__name__}, not a state dict "
            f"(a mapping of parameter names to tensors)"
        )
    return state_dict


def load_torchscript(path: Path, device: torch.device) -> torch.nn.Module:
    """A model saved with ``torch.jit.save``."""
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
    return model


def is_torchscript_archive(path: Path) -> bool:
    """Whether ``path`` is a zip in torch.jit.save's layout (it has a ``constants.pkl``)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("/constants.pkl") for name in archive.namelist())


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
