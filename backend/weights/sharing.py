"""How a model's weights are held in memory: the model-config.yaml switch ``share_weights``.

* ``true`` (the default): the weights stay in the weights file's pages (``torch.load(mmap=
  True)``, safetensors' own mapping), so every worker of the model on this host reads the same
  page-cache pages: N workers on the CPU hold one copy. On CUDA each worker copies them from
  those pages to its own GPU memory.
* ``false``: every worker reads the file into memory of its own, as TorchServe does.
* ``cuda_ipc``: as ``true`` on the CPU; on CUDA, one owner process per GPU holds the weights
  and the workers of the model on that GPU use them through CUDA IPC, so a second worker
  costs its activations, not a copy of the weights (``backend.weights.cuda_ipc``). Off by
  default: written and tested on the CPU, not yet measured on a GPU.

Written under the model config's ``handler`` section, with batchserve's other handler
options::

    handler:
      share_weights: cuda_ipc
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

from backend.errors import ModelLoadError

#: The key under model-config.yaml's ``handler`` section.
SHARE_WEIGHTS = "share_weights"


class Sharing(Enum):
    """What ``share_weights`` asks for."""

    #: Memory-mapped from the file (the default).
    MMAP = "mmap"
    #: A private copy per worker (TorchServe's way).
    COPY = "copy"
    #: Memory-mapped on the CPU; one GPU copy per GPU shared through CUDA IPC.
    CUDA_IPC = "cuda_ipc"


_VALUES: dict[object, Sharing] = {True: Sharing.MMAP, "true": Sharing.MMAP,
                                  "mmap": Sharing.MMAP, False: Sharing.COPY,
                                  "false": Sharing.COPY, "copy": Sharing.COPY,
                                  "cuda_ipc": Sharing.CUDA_IPC}


def read_sharing(config: Mapping[str, Any] | None) -> Sharing:
    """``handler.share_weights`` of a model config (the default when absent). Raises
    ModelLoadError for a value it does not know."""
    handler = (config or {}).get("handler")
    if not isinstance(handler, Mapping) or handler.get(SHARE_WEIGHTS) is None:
        return Sharing.MMAP
    value = handler[SHARE_WEIGHTS]
    key = value.lower() if isinstance(value, str) else value
    try:
        return _VALUES[key]
    except (KeyError, TypeError):
        raise ModelLoadError(f"model-config.yaml: handler.{SHARE_WEIGHTS} must be true, false "
                             f"or cuda_ipc, got {value!r}") from None
