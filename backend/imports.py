"""Import a source file from a model archive under a module name nothing else has.

Handler and model files are imported by path, never by a bare name that could collide with
the worker's own packages (STYLE trap 22).
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import sys
from pathlib import Path
from types import ModuleType

_numbers = itertools.count(1)


class FileImportError(Exception):
    """The file is not importable Python, or executing it raised; the message says why."""


def import_file(path: Path, prefix: str) -> ModuleType:
    """Execute ``path`` as a fresh module named ``_batchserve_<prefix>_<n>_<stem>``."""
    from backend.errors import describe

    stem = re.sub(r"\W", "_", path.stem)
    name = f"_batchserve_{prefix}_{next(_numbers)}_{stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise FileImportError("not a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise FileImportError(describe(exc)) from exc
    return module
