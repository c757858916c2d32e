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
from pathlib import Path, PurePosixPath

from backend.handlers import BUILTIN_HANDLERS
from backend.loader import TORCHSERVE_HANDLERS, find_handler_file, handler_file_candidates

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


def modules_for(handler: str, model_dir: str) -> list[str]:
    """The modules to import before forking a worker of the model whose manifest names
    ``handler`` (in the archive unpacked at ``model_dir``)."""
    module_part = _module_part(handler)
    if not module_part:
        return []
    builtin = _builtin_or_torchserve(module_part, has_file=True)
    if builtin:
        return builtin
    folder = Path(model_dir)
    try:
        path = find_handler_file(folder, module_part)
    except (OSError, ValueError):
        return []
    if path is None:
        return _builtin_or_torchserve(module_part, has_file=False)
    try:
        if path.stat().st_size > MAX_HANDLER_BYTES:
            return []
        source = path.read_bytes()
    except OSError:
        return []
    return [name for name in imports_in(source, str(path)) if not _in_archive(name, folder)]


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
    manifest = json.loads(zipped.read(MANIFEST))
    module_part = _module_part(_handler_of(manifest))
    if not module_part:
        return []
    builtin = _builtin_or_torchserve(module_part, has_file=True)
    if builtin:
        return builtin
    found = next((name for name in handler_file_candidates(module_part) if name in names),
                 None)
    if found is None:
        return _builtin_or_torchserve(module_part, has_file=False)
    if zipped.getinfo(found).file_size > MAX_HANDLER_BYTES:
        return []
    tops = {PurePosixPath(name).parts[0] for name in names if name}
    return [name for name in imports_in(zipped.read(found), found)
            if name.partition(".")[0] not in tops
            and f"{name.partition('.')[0]}.py" not in tops]


def _handler_of(manifest: object) -> str:
    model = manifest.get("model") if isinstance(manifest, dict) else None
    handler = model.get("handler") if isinstance(model, dict) else None
    return handler if isinstance(handler, str) else ""


def _module_part(handler: str) -> str:
    return handler.strip().partition(":")[0].strip()


def _builtin_or_torchserve(module_part: str, *, has_file: bool) -> list[str]:
    """The module of a handler named by a built-in name (``image_classifier``), or, when the
    archive has no file of that name, of TorchServe's handler of that name (others,
    ``densenet_handler``, resolve in ts.torch_handler)."""
    builtin = BUILTIN_HANDLERS.get(module_part)
    if builtin is not None:
        return [builtin.partition(":")[0]]
    if has_file:
        return []
    name = f"{TORCHSERVE_HANDLERS}.{module_part}"
    return [name] if is_fork_safe(name) else []


def imports_of(path: Path) -> list[str]:
    """The fork-safe modules ``path`` imports at its top level (absolute imports only), in
    order; none when it cannot be read or parsed."""
    try:
        if path.stat().st_size > MAX_HANDLER_BYTES:
            return []
        return imports_in(path.read_bytes(), str(path))
    except OSError:
        return []


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


def _in_archive(name: str, model_dir: Path) -> bool:
    """``name``'s top package is a module or package of the archive itself."""
    top = name.partition(".")[0]
    return (model_dir / f"{top}.py").exists() or (model_dir / top).is_dir()
