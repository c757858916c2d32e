"""Resolve a manifest's ``handler`` string to an initialised entry point, as TorchServe does.

``"name"`` of a built-in handler, ``"file.py"``, ``"file"``, ``"file.py:function"`` or
``"module:function"``. A name that is neither a file of the archive nor one of
``backend.handlers``' is looked up as TorchServe does, as a module of ``ts.torch_handler``
(``densenet_handler``, ``vllm_handler``, ...; batchserve's ``ts`` shim has them all). A
file is imported by path from the model directory under a unique module name, after the
worker's own imports (STYLE trap 22): a model whose archive holds a ``service.py`` or
``backend.py`` cannot shadow the worker's modules. A coroutine ``handle`` (TorchServe's
async handlers) is run to its end on the worker's event loop (``run_coroutines``). The model
directory also joins ``sys.path`` so the handler can import the archive's other modules, as
do the folders the model's own packages were installed into (``add_dependency_dirs``).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import logging
import site
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from backend.context import Context
from backend.errors import BatchSizeMismatch, HandlerLoadError, InvalidHandlerOutput, describe
from backend.handlers import builtin_handler
from backend.imports import FileImportError, import_file

logger = logging.getLogger(__name__)

DEFAULT_FUNCTION = "handle"

HandleFn = Callable[[Any, Context], Any]
#: Where TorchServe looks up a handler given by name (a module of this package).
TORCHSERVE_HANDLERS = "ts.torch_handler"



@dataclass(frozen=True, slots=True)
class EntryPoint:
    """The callable that runs one batch: ``handle(data, context)``."""

    handle: HandleFn
    name: str
    """How to name the handler in messages, e.g. ``echo.py:handle`` or ``ImageClassifier``."""


def one_result_each(results: Any, count: int, handler: str, unit: str = "requests"
                    ) -> list[Any]:
    """``results``, what ``handler`` returned for a batch of ``count`` ``unit``, as a list of
    one result per item. Raises InvalidHandlerOutput when it is not a list, BatchSizeMismatch
    when it holds another number of results."""
    if not isinstance(results, (list, tuple)):
        raise InvalidHandlerOutput(
            f"{handler} returned {type(results).__name__}, expected a list of {count} results")
    if len(results) != count:
        raise BatchSizeMismatch(
            f"{handler} returned {len(results)} results for a batch of {count} {unit}")
    return list(results)


def load_entry_point(handler: str, model_dir: Path, context: Context) -> EntryPoint:
    """Import the handler named by ``handler`` and initialise it with ``context``.

    Raises HandlerLoadError when the handler cannot be found or imported; an exception raised
    by the handler's own initialisation propagates unchanged.
    """
    handler = handler.strip()
    if not handler:
        raise HandlerLoadError("no handler was given")
    module_part, _, function_part = handler.partition(":")
    function_name = function_part.strip() or None

    path = find_handler_file(model_dir, module_part)
    if path is None:
        if function_name is None:
            cls = _builtin_class(module_part) or _torchserve_handler_class(module_part)
            if cls is not None:
                return _initialise_class(cls, context, cls.__name__)
        raise HandlerLoadError(
            f"handler {handler!r}: no file {_file_name(module_part)!r} in {model_dir}"
            + ("" if function_name else " and no built-in handler of that name")
        )

    _add_to_sys_path(model_dir)
    if path.parent.resolve() != model_dir.resolve():
        # A handler file outside the model (default_service_handler=/path/service.py:handle,
        # as the SageMaker toolkit sets it): its folder joins the path too, as TorchServe
        # puts it on the worker's PYTHONPATH, so it imports its neighbours.
        _add_to_sys_path(path.parent)
    module = import_handler_file(path)
    wanted = function_name or DEFAULT_FUNCTION
    function = getattr(module, wanted, None)
    if function is not None and callable(function) and not isinstance(function, type):
        # TorchServe's convention: a function entry point is initialised by a call with no data.
        function = run_coroutines(function)
        function(None, context)
        return EntryPoint(function, f"{path.name}:{wanted}")
    # No such function: the file's one handler class, as TorchServe falls back to it even
    # when a function is named (the SageMaker toolkit names ``handle`` of a file that defines
    # only its HandlerService class).
    try:
        cls = find_handler_class(module, path.name)
    except HandlerLoadError as exc:
        if function_name is None:
            raise
        raise HandlerLoadError(f"handler {handler!r}: {path.name} has no function {wanted!r} "
                               f"and no handler class to use instead ({exc})") from None
    return _initialise_class(cls, context, f"{path.name}:{cls.__name__}")


def find_handler_file(model_dir: Path, module_part: str) -> Path | None:
    """The handler's source file inside ``model_dir``, or None."""
    for name in handler_file_candidates(module_part):
        candidate = model_dir / name
        if candidate.is_file():
            return candidate
    return None


def handler_file_candidates(module_part: str) -> list[str]:
    """Where in an archive the handler's source file may be, relative to its root, in the
    order they are tried."""
    module_part = module_part.strip()
    if not module_part:
        return []
    file_name = _file_name(module_part)
    candidates = [file_name, Path(file_name).name]
    if not module_part.endswith(".py") and "." in module_part and "/" not in module_part:
        candidates.append(module_part.replace(".", "/") + ".py")  # "pkg.module"
    return list(dict.fromkeys(candidates))


def import_handler_file(path: Path) -> ModuleType:
    """Import one source file under a module name no other module can have."""
    try:
        module = import_file(path, "handler")
    except FileImportError as exc:
        raise HandlerLoadError(f"cannot import handler {path.name}: {exc}") from exc
    logger.debug("imported handler %s as module %s", path, module.__name__)
    return module


def find_handler_class(module: ModuleType, file_name: str) -> type:
    """The one class with a ``handle`` method that ``module`` itself defines.

    Classes the module imports (a base handler, a model class) do not count, nor do abstract
    classes or classes that another candidate derives from.
    """
    defined = [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type) and obj.__module__ == module.__name__
    ]
    with_handle = [
        cls
        for cls in defined
        if callable(getattr(cls, "handle", None)) and not inspect.isabstract(cls)
    ]
    leaves = [
        cls
        for cls in with_handle
        if not any(o is not cls and issubclass(o, cls) for o in with_handle)
    ]
    if len(leaves) == 1:
        return leaves[0]
    if len(leaves) > 1:
        names = ", ".join(cls.__name__ for cls in leaves)
        raise HandlerLoadError(
            f"{file_name} defines {len(leaves)} handler classes ({names}); expected exactly one, "
            f"or a function {DEFAULT_FUNCTION}(data, context)"
        )
    if defined:
        names = ", ".join(cls.__name__ for cls in defined)
        raise HandlerLoadError(
            f"{file_name} has no function {DEFAULT_FUNCTION}(data, context) and none of its "
            f"classes ({names}) has a handle method"
        )
    raise HandlerLoadError(
        f"{file_name} defines neither a function {DEFAULT_FUNCTION}(data, context) nor a "
        f"handler class"
    )


def _initialise_class(cls: type, context: Context, name: str) -> EntryPoint:
    instance = cls()
    initialize = getattr(instance, "initialize", None)
    if callable(initialize):
        initialize(context)
    handle = getattr(instance, "handle", None)
    if not callable(handle):
        raise HandlerLoadError(f"handler class {cls.__name__} has no handle method")
    return EntryPoint(run_coroutines(handle), name)


def run_coroutines(handle: HandleFn) -> HandleFn:
    """``handle`` itself, or, for a coroutine function (TorchServe's async handlers, e.g. its
    vLLM one), a function that runs each call to the end on this thread's event loop (made
    and set as current on first use, so a handler's ``initialize`` that ran work on
    ``asyncio.get_event_loop()`` shares it). Batches still come one at a time; the loop runs
    only during a call. The bound handler stays reachable as ``__self__``."""
    if not inspect.iscoroutinefunction(handle):
        return handle

    def run(data: Any, context: Context) -> Any:
        return _event_loop().run_until_complete(handle(data, context))

    run.__self__ = getattr(handle, "__self__", None)  # type: ignore[attr-defined]
    run.__name__ = getattr(handle, "__name__", "handle")
    return run


def _event_loop() -> asyncio.AbstractEventLoop:
    """This thread's current event loop (one a handler's initialize set, or made now)."""
    with warnings.catch_warnings():  # Python 3.12+ warns where none is set yet
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            loop = asyncio.get_event_loop()
        except RuntimeError:  # Python 3.14+: none set on this thread yet
            loop = None
    if loop is None or loop.is_closed():
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
    return loop


def _torchserve_handler_class(name: str) -> type | None:
    """The handler class of ``ts.torch_handler.<name>``, as TorchServe resolves a handler
    name; None when there is no such module (or no ``ts`` at all)."""
    module_name = f"{TORCHSERVE_HANDLERS}.{name}"
    if not name.isidentifier():
        return None
    try:
        if importlib.util.find_spec(module_name) is None:
            return None
    except ModuleNotFoundError:  # no ts package
        return None
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an optional package it needs (vllm, DALI, ...) is missing
        raise HandlerLoadError(f"cannot import TorchServe's handler {module_name}: "
                               f"{describe(exc)}") from exc
    return find_handler_class(module, module_name)


def _builtin_class(name: str) -> type | None:
    try:
        return builtin_handler(name)
    except Exception as exc:
        raise HandlerLoadError(f"cannot import built-in handler {name!r}: {describe(exc)}") from exc


def _file_name(module_part: str) -> str:
    module_part = module_part.strip()
    return module_part if module_part.endswith(".py") else f"{module_part}.py"


def add_dependency_dirs(dirs: Sequence[str]) -> None:
    """Put the folders the model's requirements were installed into (``pip install --target``)
    on ``sys.path`` ahead of the server's packages, as site directories: their ``.pth`` files
    are read as pip's own installs would be. Called after the worker's own imports (STYLE
    trap 22): a requirement named like a worker module cannot shadow it."""
    if not dirs:
        return
    sys.path[0:0] = [entry for entry in dirs if entry not in sys.path]
    for entry in dirs:
        site.addsitedir(entry)  # on sys.path already: only its .pth files are read
    importlib.invalidate_caches()


def _add_to_sys_path(model_dir: Path) -> None:
    entry = str(model_dir)
    if entry not in sys.path:
        sys.path.insert(0, entry)
        importlib.invalidate_caches()
