"""Stand-ins for the packages of other servers that unmodified handlers import.

``ts/`` here is a small TorchServe ``ts`` package: enough of ``ts.torch_handler``,
``ts.utils.util``, ``ts.handler_utils`` and ``ts.context`` for TorchServe custom handlers to
run in our worker. It becomes the top-level ``ts`` only inside a worker, and only when no real
TorchServe is installed (``install_torchserve_shim``); nothing named ``ts`` is ever installed
into site-packages, so a real TorchServe can live beside us.

NOTE: this directory itself joins ``sys.path``, so every module in it becomes importable by its
bare name. Keep it to this file and ``ts/``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent
"""The directory that holds the ``ts`` package; appended to ``sys.path`` by the shim."""


def install_torchserve_shim() -> bool:
    """Make ``import ts`` find our stand-in, unless some ``ts`` is importable already.

    The directory is appended, not prepended: a real TorchServe (or a ``ts`` the model
    archive ships) always wins. Returns whether ``import ts`` now resolves to the shim.
    """
    spec = importlib.util.find_spec("ts")
    if spec is not None:
        return spec.origin is not None and Path(spec.origin).is_relative_to(SHIM_DIR)
    sys.path.append(str(SHIM_DIR))
    importlib.invalidate_caches()
    return True
