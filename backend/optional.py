"""Optional packages a module needs at import time, with an error that says what is missing.

TorchServe's modules for vLLM, TensorRT-LLM, DALI, DeepSpeed, PiPPy and Hugging Face import
those packages when they are imported; batchserve's ``ts`` modules do the same (a handler
that imports one learns at once that the package is missing), but the error names the
package, the module that needs it and how to install it.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(package: str, needed_by: str, install: str | None = None) -> ModuleType:
    """Import ``package`` (a dotted name) or raise ModuleNotFoundError naming it.

    The error's ``name`` is the missing module, as Python's own import error sets it, so
    code that checks ``exc.name`` behaves as it would with TorchServe.
    """
    try:
        return importlib.import_module(package)
    except ModuleNotFoundError as exc:
        how = install or f"pip install {package.split('.')[0]}"
        raise ModuleNotFoundError(
            f"{needed_by} needs {package}, which is not installed ({how}); TorchServe's "
            f"{needed_by} imports it too. Missing: {exc.name or package}",
            name=exc.name or package,
        ) from exc
