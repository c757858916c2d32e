"""What a model's name and version may be: a value every route, RPC and file system carries.

A name or version travels as a URL path segment (``/predictions/{name}/{version}``, KServe's
``/v2/models/{name}/versions/{version}``), a gRPC field, a metric label, and part of a folder
name (the unpacked archive, the model's own packages). So, beyond TorchServe's character rule
for names (letters, digits, ``_``, ``-``, ``.``; first a letter or a digit), which versions
follow too:

- at most ``MAX_NAME_CHARS`` (``MAX_VERSION_CHARS``) characters: a folder named after both
  stays within the 255 bytes of a file name, and a request line within the URL limit;
- not a name Windows reserves for a device (``CON``, ``NUL``, ``COM1``, ... with or without
  an extension: ``con.v2`` too), and not ending in ``.`` (which Windows drops).
"""

from __future__ import annotations

import re

from model_archiver.quoting import quoted

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
MAX_NAME_CHARS = 128
MAX_VERSION_CHARS = 64
RESERVED_NAMES = frozenset({"CON", "PRN", "AUX", "NUL",
                            *(f"{port}{digit}" for port in ("COM", "LPT") for digit in range(10))})
_CHARACTERS = "letters, digits, '_', '-' and '.', beginning with a letter or a digit"


def name_problem(name: str, what: str = "model name") -> str | None:
    """Why ``name`` cannot name a model (None: it can). ``what`` names it in the message: a
    workflow's name follows the same rule (``workflow_archiver``)."""
    return _problem(what, name, MAX_NAME_CHARS)


def version_problem(version: str) -> str | None:
    """Why ``version`` cannot be a model's version (None: it can)."""
    return _problem("model version", version, MAX_VERSION_CHARS)


def _problem(what: str, value: str, max_chars: int) -> str | None:
    shown = quoted(value, 40)
    if len(value) > max_chars:
        return f"invalid {what} {shown}: at most {max_chars} characters ({len(value)} given)"
    if not NAME_PATTERN.fullmatch(value):
        return f"invalid {what} {shown}: use {_CHARACTERS}"
    stem = value.split(".", 1)[0]
    if stem.upper() in RESERVED_NAMES:
        return f"invalid {what} {shown}: {stem} is a device name that Windows reserves"
    if value.endswith("."):
        return f"invalid {what} {shown}: it may not end with '.'"
    return None
