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
import json
import zipfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from backend.handlers import BUILTIN_HANDLERS
from backend.service.loader import TORCHSERVE_HANDLERS, find_handler_file, handler_file_candidates

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
MANIFEST = "MAR-INF/MANIFEST.json"


#: A handler file found: its name (for messages) and its source (b"" when it is too large or
#: cannot be read: nothing is imported for it); None when the archive has no such file.
_Found = tuple[str, bytes] | None


def modules_for(handler: str, model_dir: str) -> list[str]:
    """The modules to import before forking a worker of the model whose manifest names
    ``handler`` (in the archive unpacked at ``model_dir``)."""
    folder = Path(model_dir)

    def read(module_part: str) -> _Found:
        try:
            path = find_handler_file(folder, module_part)
            if path is None:
                return None
            too_large = path.stat().st_size > MAX_HANDLER_BYTES
            return str(path), b"" if too_large else path.read_bytes()
        except (OSError, ValueError):
            return "", b""

    def own(top: str) -> bool:
        return (folder / f"{top}.py").exists() or (folder / top).is_dir()

    return _handler_modules(handler, read, own)


def modules_for_archive(archive: Path) -> list[str]:
    """The modules to import for the model of a ``.mar`` file or an archive folder not
    unpacked yet (the startup models: the fork server imports them while the frontend
    unpacks them). None for what cannot be read here (a .tar.gz, a broken file)."""
    try:
        if archive.is_dir():
            manifest = json.loads((archive / MANIFEST).read_bytes())
            return modules_for(_handler_of(manifest), str(archive))
        if not zipfile.is_zipfile(archive):
            return []
        with zipfile.ZipFile(archive) as zipped:
            return _modules_in_zip(zipped)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return []


def _modules_in_zip(zipped: zipfile.ZipFile) -> list[str]:
    names = set(zipped.namelist())
    tops = {PurePosixPath(name).parts[0] for name in names if name}

    def read(module_part: str) -> _Found:
        found = next((name for name in handler_file_candidates(module_part) if name in names),
                     None)
        if found is None:
            return None
        too_large = zipped.getinfo(found).file_size > MAX_HANDLER_BYTES
        return found, b"" if too_large else zipped.read(found)

    def own(top: str) -> bool:
        return top in tops or f"{top}.py" in tops

    return _handler_modules(_handler_of(json.loads(zipped.read(MANIFEST))), read, own)


def _handler_modules(handler: str, read: Callable[[str], _Found],
                     own: Callable[[str], bool]) -> list[str]:
    """What a model whose manifest names ``handler`` needs imported, its archive read through
    ``read`` (its handler file, by the handler's module part) and ``own`` (whether a top-level
    module name is the archive's own, which only the worker can import)."""
    module_part = handler.strip().partition(":")[0].strip()
    if not module_part:
        return []
    builtin = BUILTIN_HANDLERS.get(module_part)
    if builtin is not None:
        return [builtin.partition(":")[0]]
    found = read(module_part)
    if found is None:
        # TorchServe's name for one of its handlers (``image_classifier`` is ours; others,
        # ``densenet_handler``, resolve in ts.torch_handler).
        name = f"{TORCHSERVE_HANDLERS}.{module_part}"
        return [name] if is_fork_safe(name) else []
    filename, source = found
    return [name for name in imports_in(source, filename) if not own(name.partition(".")[0])]


def _handler_of(manifest: object) -> str:
    model = manifest.get("model") if isinstance(manifest, dict) else None
    handler = model.get("handler") if isinstance(model, dict) else None
    return handler if isinstance(handler, str) else ""


def imports_in(source: bytes, filename: str) -> list[str]:
    """The fork-safe modules a handler's ``source`` imports at its top level."""
    try:
        tree = ast.parse(source, filename=filename)
    except (SyntaxError, ValueError):
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
