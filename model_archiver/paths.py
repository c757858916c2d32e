"""One rule for every path that something outside the server names: an archive's member, a
manifest's file, a spec's url, a register url's path, a download's file name, a folder's
link. ``contained`` is the only place it is written; every caller passes its path through it.

Here, and not in the frontend, because everything that meets such paths may import it: the
frontend, both archivers (which import only ``model_archiver``), and the backend (which may
not import the frontend).

What ``contained(name, root)`` refuses (``UnsafePath``, its ``why`` saying which rule), in
this order, so that nothing touches the file system before the text itself is judged:

1. the text alone, with no file system access (nothing can race it):

   - a ``..`` part, where ``\\`` separates parts as ``/`` does (an archive written on
     Windows: ``a\\..\\..\\x``);
   - a NUL byte, or a character no file name can be encoded with;
   - a name over ``MAX_PATH_BYTES``, or one of its parts over ``MAX_NAME_BYTES`` (what
     Linux's file systems hold: a longer one fails half way through an extraction);
   - an absolute name: ``\\x`` and ``C:x`` (Windows') always, ``/x`` unless
     ``absolute=True`` (a url's path, which is read where it is).

   ``.`` parts and empty ones are harmless; ``.`` or ``""`` names the root itself. Unicode
   look-alikes (U+2025 two dot leader, U+FF0E fullwidth full stops, U+2215 division slash)
   are ordinary characters here, never ``..`` or a separator: nothing on this side
   normalises them into one.

2. with ``root``, the name's links resolved (``Path.resolve``) must lead to ``root`` or
   below it (a link in a folder that points out, a folder link and a file reached through
   it); a link loop, or a path that cannot be resolved, is refused too. Without ``root``
   only the text is judged (a name in an archive being written or read, a spec's url).

The callers that unpack archives check every member before they write any, and refuse
members that are links themselves (a zip member whose mode is a link; in a tar anything but
a file or a folder, hard links included): so what step 2 saw cannot change under it, as the
extraction's target is a fresh private folder that holds nothing else.
"""

from __future__ import annotations

import enum
import os
import re
from pathlib import Path, PurePosixPath
from typing import overload

__all__ = ["MAX_NAME_BYTES", "MAX_PATH_BYTES", "Unsafe", "UnsafePath", "climbs", "contained"]

#: The longest part of a path (a file or folder name) file systems here hold: NAME_MAX.
MAX_NAME_BYTES = 255
#: The longest path: PATH_MAX.
MAX_PATH_BYTES = 4096

#: Both separators: ``/``, and ``\\`` as Windows writes it.
_SEPARATORS = re.compile(r"[/\\]")
#: A Windows drive at the start of a name: ``C:``, ``c:x``.
_DRIVE = re.compile(r"[A-Za-z]:")


class Unsafe(enum.Enum):
    """Why a path was refused (the messages say it after the path)."""

    CHARACTER = "has a NUL byte or a character no file name can hold"
    LENGTH = f"is too long (a name over {MAX_NAME_BYTES} or a path over {MAX_PATH_BYTES} bytes)"
    ABSOLUTE = "is absolute"
    PARENT = "has a '..' part"
    OUTSIDE = "leads outside"
    UNRESOLVABLE = "cannot be resolved (a link loop?)"


class UnsafePath(ValueError):
    """A path ``contained`` refuses: ``name`` as given, ``why`` it was refused, and for
    ``Unsafe.OUTSIDE`` the ``target`` it resolved to."""

    def __init__(self, name: str, why: Unsafe, target: Path | None = None) -> None:
        self.name = name
        self.why = why
        self.target = target
        where = f" (to {target})" if target is not None else ""
        super().__init__(f"{name!r} {why.value}{where}")


@overload
def contained(name: str | os.PathLike[str], root: None = None, *,
              absolute: bool = False) -> PurePosixPath: ...


@overload
def contained(name: str | os.PathLike[str], root: Path, *, absolute: bool = False) -> Path: ...


def contained(name: str | os.PathLike[str], root: Path | None = None, *,
              absolute: bool = False) -> PurePosixPath | Path:
    """``name``, judged by the rules of this module's docstring: without ``root``, the name
    with ``/`` separators; with ``root``, where it leads once links are resolved (inside
    ``root``). Raises UnsafePath otherwise. ``absolute``: a name starting with ``/`` is
    allowed (and, with ``root``, must resolve inside it)."""
    text = os.fspath(name)
    parts = _SEPARATORS.split(text)
    if ".." in parts:  # first: whatever else is wrong too, this is what a reader sees
        raise UnsafePath(text, Unsafe.PARENT)
    _check_text(text, parts)
    is_posix_absolute = text.startswith("/")
    if text.startswith("\\") or _DRIVE.match(parts[0]) or (is_posix_absolute and not absolute):
        raise UnsafePath(text, Unsafe.ABSOLUTE)
    if root is None:
        return PurePosixPath(text.replace("\\", "/"))
    target = Path(text) if is_posix_absolute else root / text
    try:
        real_root, real = root.resolve(), target.resolve()
    except (OSError, RuntimeError, ValueError):
        raise UnsafePath(text, Unsafe.UNRESOLVABLE) from None
    if real != real_root and real_root not in real.parents:
        raise UnsafePath(text, Unsafe.OUTSIDE, real)
    return real


def climbs(name: str) -> bool:
    """Whether ``name`` has a ``..`` part, as ``contained`` reads parts (its first rule,
    whatever else is wrong with it): TorchServe's "Relative path is not allowed in url"."""
    try:
        contained(name, absolute=True)
    except UnsafePath as exc:
        return exc.why is Unsafe.PARENT
    return False


def _check_text(text: str, parts: list[str]) -> None:
    if "\x00" in text:
        raise UnsafePath(text, Unsafe.CHARACTER)
    try:
        too_long = len(os.fsencode(text)) > MAX_PATH_BYTES or any(
            len(os.fsencode(part)) > MAX_NAME_BYTES for part in parts)
    except UnicodeError:  # a lone surrogate: no file name can be encoded with it
        raise UnsafePath(text, Unsafe.CHARACTER) from None
    if too_long:
        raise UnsafePath(text, Unsafe.LENGTH)
