"""What ``--handler`` may name, as torch-model-archiver 0.12 decides it: a built-in handler by
its bare name, or a handler file that exists.

TorchServe's archiver takes a bare name only when it is one of its built-ins
(``BUILTIN_HANDLERS``); anything else is a file, ``.py`` added when the value has none
(``my_handler`` and ``my_handler:handle`` both mean ``my_handler.py``), and a file that is not
there fails the archive. So a misspelt built-in (``image_clasifier``) is refused instead of
becoming an archive that no server can load; the message here names the built-ins and the
closest one. Where this archiver differs: ``handler.py:function`` is taken (TorchServe's
archiver looks for a file named ``handler.py:function`` and fails, though its server loads
such a manifest), and an empty ``--handler`` is refused (TorchServe's writes an archive that
no server can load).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from model_archiver.errors import ModelArchiverError

__all__ = ["BUILTIN_HANDLERS", "resolve_handler"]

BUILTIN_HANDLERS = frozenset({
    "base_handler", "dali_image_classifier", "image_classifier", "image_segmenter",
    "object_detector", "text_classifier", "trt_llm_handler", "vllm_handler",
})
"""The names torch-model-archiver 0.12 takes as built-in handlers (its ``model_handlers``);
the worker loads each: batchserve's own built-ins, the rest from its ``ts.torch_handler``."""


def resolve_handler(handler: str) -> tuple[str, Path | None]:
    """The manifest's ``handler`` value for ``--handler`` and the file to pack (None for a
    built-in); ModelArchiverError when it names neither a built-in nor an existing file.

    ``dir/my_handler.py:handle`` -> (``my_handler.py:handle``, ``dir/my_handler.py``);
    ``dir/my_handler`` -> (``my_handler``, ``dir/my_handler.py``);
    ``image_classifier`` -> (``image_classifier``, None).
    """
    if not handler.strip():
        raise ModelArchiverError("--handler must not be empty")
    module, sep, function = handler.rpartition(":")
    # Only an identifier after the last ":" names a function; "C:\\h.py" stays a path.
    if not (sep and module and function.isidentifier()):
        module, function = handler, ""
    suffix = f":{function}" if function else ""
    if not function and handler in BUILTIN_HANDLERS:
        return handler, None

    candidate = Path(module)
    if candidate.is_file():
        return f"{candidate.name}{suffix}", candidate
    # As torch-model-archiver: a name without ".py" is the module's file ("handlers/h").
    with_py = Path(f"{module}.py")
    if not module.endswith(".py") and with_py.is_file():
        return f"{candidate.name}{suffix}", with_py
    raise ModelArchiverError(_refusal(handler, module, function))


def _refusal(handler: str, module: str, function: str) -> str:
    file = module if module.endswith(".py") else f"{module}.py"
    if module.endswith(".py") or "/" in module or os.sep in module:
        return f"--handler {handler}: handler file {file} does not exist"
    if module in BUILTIN_HANDLERS:
        return (f"--handler {handler}: no handler file {file}, and a built-in handler takes "
                f"no ':function' (--handler {module})")
    # "ts.torch_handler.image_clasifier" is compared by its last part.
    close = difflib.get_close_matches(module.rpartition(".")[2], BUILTIN_HANDLERS, n=1,
                                      cutoff=0.8)
    hint = f"; did you mean {close[0]}?" if close else ""
    builtins = ", ".join(sorted(BUILTIN_HANDLERS))
    return (f"--handler {handler}: not a built-in handler and no handler file {file} "
            f"exists{hint} (the built-in handlers: {builtins})")
