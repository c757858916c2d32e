"""Stand-ins for the packages of other servers that unmodified handlers import.

``ts/`` here is TorchServe's ``ts`` package as batchserve provides it: every public module,
class and function of TorchServe 0.12's, with its signature (``tests/unit/test_ts_coverage.py``
compares them with the real wheel), written against our backend so that TorchServe custom
handlers run in our worker. It becomes the top-level ``ts`` only inside a worker, and only
when no real TorchServe is installed (``install_torchserve_shim``); nothing named ``ts`` is
ever installed into site-packages, so a real TorchServe can live beside us. A ``ts/`` folder
in a model's archive or the working directory never stands in for either.

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
    """Make ``import ts`` find our stand-in, unless a ``ts`` is installed (a real
    TorchServe), and import that ``ts`` now. Returns whether it is the shim.

    Called before a model's folder joins ``sys.path`` (the worker's working directory is
    never on it): once imported, ``ts`` and its submodules resolve from where it was found,
    so a ``ts/`` in an archive or in the working directory cannot stand in for it.
    """
    spec = importlib.util.find_spec("ts")
    if spec is None:
        sys.path.append(str(SHIM_DIR))
        importlib.invalidate_caches()
    try:
        module = importlib.import_module("ts")
    except Exception:  # a broken installed ts: handlers that import it will say so
        return False
    origin = getattr(module, "__file__", None)
    return origin is not None and Path(origin).resolve().is_relative_to(SHIM_DIR)
