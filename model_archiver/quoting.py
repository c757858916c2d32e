"""How a message shows what a user or client gave: a short, escaped excerpt, never the whole.

Error messages quote names, URLs, parameter values and file contents back to whoever sent
them, and the server's log repeats them. Quoted whole, a 20 MB parameter makes a 20 MB
answer, a spec that expands by YAML aliases makes a far larger one, and control characters
reach terminals and log parsers. So every message that quotes client input goes through one
of these two (the server's ``frontend.errors`` re-exports them; the archivers use them here):

* ``quoted(value)``: as ``{value!r}`` would show it (quotes, escapes for anything not
  printable), of at most ``MAX_QUOTED_CHARS`` characters of the value, and for a longer
  string how long it was: ``'aaaa…'... (20000000 characters)``. A container is shown to a few
  items and levels, without walking the rest of it.
* ``excerpt(text)``: unquoted, for messages that name a thing as TorchServe's do (``Model
  not found: name``): the text unchanged when it is short and printable, else escaped as
  ``repr`` escapes and cut as ``quoted`` cuts it.
"""

from __future__ import annotations

import reprlib

__all__ = ["MAX_QUOTED_CHARS", "excerpt", "quoted"]

MAX_QUOTED_CHARS = 100
"""The most characters of one value a message shows (escapes may make it longer)."""


class _Excerpts(reprlib.Repr):
    """``repr`` of at most a few items, levels and characters (``reprlib``'s walk stops at
    its limits), failing over to the type's name where ``repr`` itself fails."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxarray = self.maxdeque = 6
        self.maxdict = self.maxset = self.maxfrozenset = 6
        self.maxstring = self.maxother = 40
        self.maxlong = 40

    def repr1(self, x: object, level: int) -> str:
        try:
            return super().repr1(x, level)
        except Exception:  # e.g. an int beyond Python's digit limit for str()
            return f"<{type(x).__name__}>"


_EXCERPTS = _Excerpts()


def _cut(length: int, limit: int, unit: str = "characters") -> str:
    return f"... ({length} {unit})" if length > limit else ""


def quoted(value: object, limit: int = MAX_QUOTED_CHARS) -> str:
    """``value`` as ``repr`` shows it, cut to ``limit`` characters of it (see the module)."""
    if isinstance(value, str):
        return repr(value[:limit]) + _cut(len(value), limit)
    if isinstance(value, bytes | bytearray):
        return repr(value[:limit]) + _cut(len(value), limit, "bytes")
    shown = _EXCERPTS.repr(value)
    return shown if len(shown) <= limit else shown[:limit] + "..."


def excerpt(text: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """``text`` unquoted: itself when short and printable, else escaped and cut (see the
    module)."""
    shown = text[:limit]
    if not shown.isprintable():
        shown = repr(shown)[1:-1]
    return shown + _cut(len(text), limit)
