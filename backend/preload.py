"""What the fork server imports before it forks a model's worker: the modules its handler is
known to need, among those known to be safe to import in a process that forks.

A module imported in the fork server is imported once for every worker forked after it, so
it must leave nothing behind that a forked child cannot use: no thread (a child has only the
thread that forked), no GPU context, no open connection. That is known of a few packages
(``FORK_SAFE_PACKAGES``): torch and torchvision start no thread and touch no GPU until asked
to compute; numpy starts OpenBLAS's threads, which OpenBLAS stops before every fork
(``pthread_atfork``) and starts again when next needed; Pillow starts nothing; of ``ts``,
the handler modules (``TS_MODULES``) that import nothing but those (not its vLLM, DALI,
DeepSpeed or TensorRT-LLM modules). Anything else a handler
imports (transformers, a tokenizer, the archive's own modules) is imported by each worker
itself, after the fork, as a fresh worker would; an operator who knows a package to be safe
names it in ``fork_preload``.

The handler's own file is never executed here: its top-level imports are read from its
syntax tree. A module whose name is also a file or folder of the archive is left to the
worker (it would import the archive's, not the installed one).
"""

from __future__ import annotations

import ast
from pathlib import Path

from backend.handlers import BUILTIN_HANDLERS
from backend.loader import TORCHSERVE_HANDLERS, find_handler_file

#: Packages whose import starts no thread a fork would lose and opens no GPU context.
FORK_SAFE_PACKAGES = frozenset({"torch", "torchvision", "numpy", "PIL"})
#: TorchServe's modules (ours, or TorchServe's own) that import nothing else.
TS_MODULES = frozenset({
    "ts", "ts.context", "ts.utils", "ts.utils.util", "ts.metrics", "ts.torch_handler",
    "ts.torch_handler.base_handler", "ts.torch_handler.vision_handler",
    "ts.torch_handler.image_classifier", "ts.torch_handler.image_segmenter",
    "ts.torch_handler.object_detector", "ts.torch_handler.text_handler",
    "ts.torch_handler.text_classifier", "ts.torch_handler.densenet_handler",
})
#: A handler file larger than this is not read for its imports.
MAX_HANDLER_BYTES = 1 << 20


def modules_for(handler: str, model_dir: str) -> list[str]:
    """The modules to import before forking a worker of the model whose manifest names
    ``handler`` (in the archive unpacked at ``model_dir``)."""
    module_part = handler.strip().partition(":")[0].strip()
    if not module_part:
        return []
    builtin = BUILTIN_HANDLERS.get(module_part)
    if builtin is not None:
        return [builtin.partition(":")[0]]
    folder = Path(model_dir)
    try:
        path = find_handler_file(folder, module_part)
    except (OSError, ValueError):
        return []
    if path is None:
        # TorchServe's name for one of its handlers (``image_classifier`` is ours; others,
        # ``densenet_handler``, resolve in ts.torch_handler).
        name = f"{TORCHSERVE_HANDLERS}.{module_part}"
        return [name] if is_fork_safe(name) else []
    return [name for name in imports_of(path) if not _in_archive(name, folder)]


def imports_of(path: Path) -> list[str]:
    """The fork-safe modules ``path`` imports at its top level (absolute imports only), in
    order; none when it cannot be read or parsed."""
    try:
        if path.stat().st_size > MAX_HANDLER_BYTES:
            return []
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return list(dict.fromkeys(name for name in names if is_fork_safe(name)))


def is_fork_safe(name: str) -> bool:
    """Whether importing module ``name`` is known to leave a process safe to fork."""
    return name.partition(".")[0] in FORK_SAFE_PACKAGES or name in TS_MODULES


def _in_archive(name: str, model_dir: Path) -> bool:
    """``name``'s top package is a module or package of the archive itself."""
    top = name.partition(".")[0]
    return (model_dir / f"{top}.py").exists() or (model_dir / top).is_dir()
