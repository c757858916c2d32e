"""Which of the fork server's modules a model's archive shadows: what a worker forked for that
model must not keep, so that its imports resolve as a fresh worker's would.

A fresh worker imports its own modules (``backend.process.worker.STARTUP_MODULES``), then puts the
archive's folders in front of ``sys.path``: from then on a module the archive ships (a
``PIL.py``, a ``colorsys.py``, a ``helper.py``, a ``torch/`` package) is imported from the
archive, unless the worker had imported that name already. The fork server has imported more
than a fresh worker has: torch, numpy, Pillow, TorchServe's handler modules and the operator's
``fork_preload``, for whichever model asked first. A forked child that kept such a module
where its archive ships one of that name would import the fork server's instead of its own.

So before each fork the fork server works out which of its top-level modules, other than the
worker's own, the model's folders (those the worker puts on ``sys.path``: ``model_folders``)
shadow: those importlib's path finder finds there as a module or a regular package (a folder
without ``__init__.py`` does not beat an installed package, in a fresh worker either). The
child drops them, with their submodules, before it becomes a worker (``drop``): it imports them
again as a fresh worker does, from where a fresh worker's ``sys.path`` finds them. A module that
is not shadowed is kept: a fresh worker would import the same file.

Two things cannot be undone by dropping a module, and then the fork server refuses to fork
(``Shadowing.refusal``; the worker starts fresh, exactly as the archive expects):

- a kept module that holds a shadowed one (torchvision's modules hold ``PIL.Image``): it would
  go on using the fork server's, where in a fresh worker it is imported after the archive's
  folder joins ``sys.path`` and gets the archive's. Dropping it too is not safe in general
  (torch's and torchvision's extensions register their operators once per process). Holding
  is seen in module globals: a module, or a class, function or object of the shadowed package.
- a shadowed package whose native extension the fork server has loaded (``torch._C``,
  ``PIL._imaging``): it stays in the process, beside the archive's own copy, which a fresh
  worker would have alone.

What is not foreseen: folders a handler adds to ``sys.path`` itself, at its import. Models with
packages of their own (``install_py_dep_per_model``, ``useVenv``) are never forked.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import BuiltinFunctionType, FunctionType, ModuleType

from backend.process.preload import MANIFEST
from backend.service.loader import find_handler_file

#: Modules of the fork server's own (and of a forked child before it becomes a worker): what
#: they hold never reaches a handler, and they are never dropped.
FORK_SERVER_MODULES = frozenset({"__main__", "__mp_main__", "backend.process.forkserver",
                                 "backend.process.forked", "backend.process.preload",
                                 "backend.process.shadowing"})
#: How many holders a refusal names.
NAMED_HOLDERS = 3


@dataclass(frozen=True, slots=True)
class Shadowing:
    """What a model's archive shadows of the fork server's modules."""

    #: The top-level modules a forked worker drops (with their submodules).
    names: tuple[str, ...] = ()
    #: Why no forked worker can import what a fresh one would ("" when one can).
    refusal: str = ""


def assess(model_dir: str, handler: str, kept: Collection[str]) -> Shadowing:
    """What the archive unpacked at ``model_dir`` (its manifest naming ``handler``) shadows of
    this process's modules, the names in ``kept`` (a fresh worker's own) aside."""
    names = shadowed(model_folders(model_dir, handler), kept)
    if not names:
        return Shadowing()
    return Shadowing(tuple(names), refusal(names))


def model_folders(model_dir: str, handler: str) -> list[str]:
    """The folders a worker of this model puts in front of ``sys.path``: the model's, its
    handler file's and its modelFile's (backend.service.loader, backend.weights)."""
    folder = Path(model_dir)
    folders = [folder]
    try:
        path = find_handler_file(folder, handler.strip().partition(":")[0])
        if path is not None:
            folders.append(path.parent)
        model = json.loads((folder / MANIFEST).read_bytes()).get("model")
        model_file = model.get("modelFile") if isinstance(model, dict) else None
        if isinstance(model_file, str) and model_file:
            folders.append((folder / model_file).parent)
    except (OSError, ValueError, AttributeError):  # no manifest (or not one): the model's own
        pass
    return list(dict.fromkeys(str(entry) for entry in folders))


def shadowed(folders: Sequence[str], kept: Collection[str]) -> list[str]:
    """The top-level modules of this process, but those in ``kept`` and the fork server's
    own, that ``folders``, put in front of ``sys.path``, would shadow."""
    tops = {name.partition(".")[0] for name in list(sys.modules)}
    cached = set(sys.path_importer_cache)
    try:
        return [top for top in sorted(tops) if top not in kept
                and top not in FORK_SERVER_MODULES and _shadows(folders, top)]
    finally:
        # The fork server keeps no finder of a model's folders (they go with the model).
        for folder in folders:
            if folder not in cached:
                sys.path_importer_cache.pop(folder, None)


def _shadows(folders: Sequence[str], top: str) -> bool:
    module = sys.modules.get(top)
    if module is None or not issubclass(type(module), ModuleType):
        return False
    try:
        spec = importlib.machinery.PathFinder.find_spec(top, list(folders))
    except (ImportError, OSError, ValueError):  # a fresh worker's import would fail as well
        return False
    if spec is None or spec.loader is None:  # not there, or only a namespace portion
        return False
    if _same_file(spec.origin, _origin(module)):
        return False
    # A finder ahead of the path (built-in and frozen modules) wins whatever sys.path holds.
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder:
            break
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is not None and find_spec(top, None) is not None:
            return False
    return True


def refusal(names: Iterable[str]) -> str:
    """Why a forked worker cannot drop ``names`` and be a fresh worker's equal ("" when it
    can): a kept module holds one of them, or one has native code loaded."""
    dropped = frozenset(names)
    holders: dict[str, set[str]] = {}
    for name, module in list(sys.modules.items()):
        if _top(name) in dropped or name in FORK_SERVER_MODULES \
                or not issubclass(type(module), ModuleType):
            continue
        for value in list(vars(module).values()):
            owner = _owner(value)
            if owner is not None and _top(owner) in dropped:
                holders.setdefault(_top(owner), set()).add(name)
    if holders:
        held = sorted(holders)
        everyone = sorted(set().union(*holders.values()))
        named = ", ".join(everyone[:NAMED_HOLDERS])
        if len(everyone) > NAMED_HOLDERS:
            named += f" and {len(everyone) - NAMED_HOLDERS} more"
        verb = "holds" if len(everyone) == 1 else "hold"
        return f"its archive shadows {', '.join(held)}, which {named} {verb}"
    native = sorted(name for name, module in list(sys.modules.items())
                    if _top(name) in dropped and _is_extension(module))
    if native:
        return (f"its archive shadows {', '.join(sorted({_top(name) for name in native}))}, "
                f"whose native code ({', '.join(native[:NAMED_HOLDERS])}) the fork server "
                f"has loaded")
    return ""


def drop(names: Collection[str]) -> None:
    """Forget the modules ``names`` and their submodules: the next import of one finds it
    anew (in a forked child, before it becomes a worker)."""
    if not names:
        return
    for name in list(sys.modules):
        if _top(name) in names:
            del sys.modules[name]


def _top(name: str) -> str:
    return name.partition(".")[0]


def _origin(module: ModuleType) -> str | None:
    attributes = vars(module)
    spec = attributes.get("__spec__")
    origin = getattr(spec, "origin", None) if spec is not None else attributes.get("__file__")
    return origin if isinstance(origin, str) else None


def _same_file(first: str | None, second: str | None) -> bool:
    if first is None or second is None:
        return False
    if first == second:
        return True
    try:
        return os.path.samefile(first, second)
    except OSError:
        return False


def _owner(value: object) -> str | None:
    """The module ``value`` (a module global) comes from: a module's own name, a class's or a
    function's module, or an object's class's module. Read without running any code of the
    value's own (a property or ``__getattr__``)."""
    kind = type(value)
    if issubclass(kind, ModuleType):
        owner = vars(value).get("__name__")
    elif issubclass(kind, type):
        owner = vars(value).get("__module__")
    elif kind is FunctionType or kind is BuiltinFunctionType:
        owner = value.__module__
    else:
        owner = vars(kind).get("__module__")
    return owner if isinstance(owner, str) else None


def _is_extension(module: object) -> bool:
    spec = vars(module).get("__spec__") if issubclass(type(module), ModuleType) else None
    return isinstance(getattr(spec, "loader", None), importlib.machinery.ExtensionFileLoader)
