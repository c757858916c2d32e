"""How a ``ServerConfig`` field declares its config.properties key(s) and parser
(``option``), and the key table derived from those declarations (``key_parsers``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, field, fields
from typing import Any

#: A config.properties value's parser: its text in, the field's value out (ValueError when
#: it is not one).
Parse = Callable[[str], object]


def option(*keys: str, parse: Parse, default: Any = MISSING,
           default_factory: Callable[[], Any] | Any = MISSING, repr: bool = True) -> Any:
    """A ServerConfig field read from config.properties ``keys`` (a later alias is the same
    setting) with ``parse``; ``repr=False`` keeps a secret out of the config's repr."""
    return field(default=default, default_factory=default_factory, repr=repr,
                 metadata={"keys": keys, "parse": parse})


def key_parsers(config_class: type) -> dict[str, tuple[str, Parse]]:
    """config.properties key -> (field name, parser), from the fields' ``option``
    declarations (a field without one is no key)."""
    return {key: (item.name, item.metadata["parse"])
            for item in fields(config_class) for key in item.metadata.get("keys", ())}
