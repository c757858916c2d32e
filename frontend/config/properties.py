"""Reading config.properties: the Java properties file, TorchServe's ``$$NAME$$`` references
to environment variables, and lines glued together by a missing newline (``unglue_lines``),
split before the references are resolved."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path

import javaproperties

from frontend.config.server import PARSERS, known_key
from frontend.config.values import shown
from frontend.errors import ConfigError

logger = logging.getLogger(__name__)


def read_properties(path: Path) -> dict[str, str]:
    """Read a Java .properties file (TorchServe's config.properties format)."""
    try:
        with path.open(encoding="utf-8") as fh:
            return dict(javaproperties.load(fh))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc


#: TorchServe's reference to an environment variable in a config value: ``$$NAME$$``.
_ENV_REFERENCE = re.compile(r"\$\$([^$]+[^$])\$\$")


def resolve_env_references(values: Mapping[str, str], environ: Mapping[str, str]
                           ) -> dict[str, str]:
    """Replace each ``$$NAME$$`` in a config file's values with that variable's value, as
    TorchServe does for every key (the SageMaker toolkit's multi-model config writes
    ``default_service_handler=$$SAGEMAKER_HANDLER$$``); a variable that is not set is an
    error, as there. A variable's value is put in as it is: never searched for references
    itself, never split into keys (``unglue_lines`` works on the file as written, before
    this), and in a JSON value never more than the string or value it stands for
    (``_resolved_json``)."""
    return {key: _resolved(key, value, environ) for key, value in values.items()}


def _resolved(key: str, value: str, environ: Mapping[str, str]) -> str:
    """``value`` (of ``key``) with its references replaced by their variables' values (in a
    JSON value, as ``_resolved_json`` puts them in)."""
    if key in _JSON_KEYS and not _ENV_REFERENCE.fullmatch(value.strip()):
        return _resolved_json(key, value, environ)
    return _ENV_REFERENCE.sub(lambda match: _variable(key, match, environ), value)


def _variable(key: str, match: re.Match[str], environ: Mapping[str, str]) -> str:
    name = match.group(1)
    if name not in environ:
        raise ConfigError(f"config key {key}: environment variable {name} (named as "
                          f"$${name}$$) is not set")
    return environ[name]


#: The keys whose value is a JSON document.
_JSON_KEYS = frozenset(("models", "model_snapshot"))


def _resolved_json(key: str, value: str, environ: Mapping[str, str]) -> str:
    """A JSON value's references resolved so that no variable changes the document's shape,
    which the file's text gives (a variable that is the whole value is the whole document):
    in a string, the variable's value is that string's text (escaped); elsewhere it must be
    one JSON value (a number, ``true``, an object...), else a ConfigError."""
    out: list[str] = []
    in_string = False
    at = copied = 0
    while at < len(value):
        char = value[at]
        match = _ENV_REFERENCE.match(value, at) if char == "$" else None
        if match is not None:
            text = _variable(key, match, environ)
            if in_string:
                text = json.dumps(text)[1:-1]
            elif not _one_json_value(text):
                raise ConfigError(f"config key {key}: environment variable {match.group(1)} "
                                  f"is not one JSON value: {shown(repr(text), 80)}")
            out.append(value[copied:at])
            out.append(text)
            at = copied = match.end()
            continue
        if in_string and char == "\\":
            at += 2
            continue
        if char == '"':
            in_string = not in_string
        at += 1
    out.append(value[copied:])
    return "".join(out)


def _one_json_value(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _is_valid(key: str, text: str, environ: Mapping[str, str]) -> bool:
    """Whether ``text``, its references resolved, is a value ``key`` accepts."""
    try:
        PARSERS[key][1](_resolved(key, text, environ).strip())
    except (ValueError, TypeError, OverflowError, RecursionError):
        return False
    return True


def unglue_lines(values: Mapping[str, str], origin: str, environ: Mapping[str, str]
                 ) -> dict[str, str]:
    """Split values that hold a second ``key=value`` glued on: a file written by appending
    lines to one that has no final newline (the SageMaker toolkit writes
    ``enable_model_api=truedefault_response_timeout=60``). A value is split only where its
    own key refuses it whole, the part before a known key is a valid value of its key, and
    that key is not set elsewhere in the file; each split is logged. (TorchServe's Java
    parsing reads such a boolean as false and loses the second key.)

    ``values`` are the file's as written, their ``$$NAME$$`` references not yet resolved
    (``environ`` resolves them only to judge a part's validity): a split falls in the file's
    own text, never inside a reference, so a variable's value is never split into keys. A
    variable that holds ``key=value`` text stays its key's value (which then refuses it)."""
    result = dict(values)
    pending = list(values.items())
    while pending:
        key, value = pending.pop()
        if key not in PARSERS or len(value) > 4096 or _is_valid(key, value, environ):
            continue
        references = [match.span() for match in _ENV_REFERENCE.finditer(value)]
        for start in range(1, len(value)):
            if any(begin < start < end for begin, end in references):
                continue  # inside a reference: the variable's value is not the file's text
            glued, sep, rest = value[start:].partition("=")
            if not sep or not known_key(glued) or glued in values:
                continue
            head = value[:start]
            if not _is_valid(key, head, environ):
                continue
            logger.warning("config: %s: %s=%s reads as two lines, %s=%s and %s=%s (a line "
                           "without its newline)", origin, key, shown(value), key, head,
                           glued, shown(rest))
            result[key] = head
            result[glued] = rest
            pending.append((glued, rest))
            break
    return result

