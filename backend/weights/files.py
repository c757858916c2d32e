"""Reading a weights file into a state dict whose tensors stay in the file's pages.

Two formats, told apart by their first bytes (not by the file's name):

* ``torch.save``'s zip (what ``torch.save(model.state_dict(), path)`` writes): read with
  ``torch.load(mmap=True, weights_only=True)``. Each tensor is a view of one private
  (copy-on-write) mapping of the file: its pages are the page cache's, shared by every process
  that maps the same file, until a process writes to one (it then gets a copy of that page
  only). ``weights_only``: loading weights never runs code from the file. A file in torch's
  legacy (pre-1.6, not zip) format cannot be mapped: it is read into memory, with a warning.
* safetensors (``save_file`` / ``save_model``): the safetensors library maps the file the
  same way (``load_file``).

``mmap=False`` reads the file into memory of this process instead (``share_weights: false``).
"""

from __future__ import annotations

import logging
import struct
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from backend.errors import ModelLoadError, describe

logger = logging.getLogger(__name__)

SAFETENSORS_SUFFIX = ".safetensors"
_HEADER_LENGTH = struct.Struct("<Q")


def is_safetensors(path: Path) -> bool:
    """Whether ``path`` is a safetensors file: an 8-byte header length, then a JSON header
    that fits in the file."""
    try:
        with path.open("rb") as file:
            head = file.read(_HEADER_LENGTH.size + 1)
            size = path.stat().st_size
    except OSError:
        return False
    if len(head) <= _HEADER_LENGTH.size:
        return False
    (length,) = _HEADER_LENGTH.unpack(head[:_HEADER_LENGTH.size])
    return head[-1:] == b"{" and _HEADER_LENGTH.size + length <= size


def is_torchscript_archive(path: Path) -> bool:
    """Whether ``path`` is a zip in torch.jit.save's layout (it has a ``constants.pkl``)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("/constants.pkl") for name in archive.namelist())


def read_state_dict(path: Path, *, mmap: bool = True) -> dict[str, Any]:
    """The state dict in ``path`` (a torch.save zip or a safetensors file), its tensors on the
    CPU, mapped from the file unless ``mmap`` is False. Raises ModelLoadError."""
    if is_safetensors(path):
        return _read_safetensors(path, mmap=mmap)
    if is_torchscript_archive(path):
        raise ModelLoadError(
            f"{path.name} is a TorchScript archive, not a state dict: archive it without "
            f"--model-file to serve it as TorchScript"
        )
    try:
        state_dict = _torch_load(path, mmap=mmap)
    except Exception as exc:  # UnpicklingError, RuntimeError from the zip reader, ...
        raise ModelLoadError(
            f"cannot load the state dict {path.name} with torch.load(weights_only=True): "
            f"{describe(exc)}; it must hold tensors only, as torch.save(model.state_dict()) "
            f"writes (or be a .safetensors file)"
        ) from exc
    if not isinstance(state_dict, Mapping):
        raise ModelLoadError(
            f"{path.name} holds a {type(state_dict).__name__}, not a state dict "
            f"(a mapping of parameter names to tensors)"
        )
    return dict(state_dict)


def _torch_load(path: Path, *, mmap: bool) -> Any:
    if mmap and zipfile.is_zipfile(path):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if mmap:
        logger.warning("%s is in torch's legacy (not zip) format, which cannot be "
                       "memory-mapped: each worker reads its own copy (save it again with "
                       "torch.save to share it)", path.name)
    return torch.load(path, map_location="cpu", weights_only=True)


def _read_safetensors(path: Path, *, mmap: bool) -> dict[str, Any]:
    from safetensors.torch import load, load_file

    try:
        if mmap:
            return dict(load_file(path, device="cpu"))
        return dict(load(path.read_bytes()))
    except Exception as exc:  # SafetensorError, an unknown dtype, ...
        raise ModelLoadError(f"cannot load the safetensors file {path.name}: "
                             f"{describe(exc)}") from exc

