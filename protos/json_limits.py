"""JSON from clients, its nesting bounded before it is parsed: shared by the frontend (the
management API's bodies, KServe's v1 and v2 bodies) and the worker (an application/json input
decoded for the handler, service envelopes).

Python's JSON reader recurses once per level: 1,000 levels (``[[[[...``, a few KB) raise
RecursionError, and a document a little shallower than that is read but fails later, in
whatever recurses over it (writing it back, a handler). ``check_depth`` refuses a document
nested deeper than ``MAX_JSON_DEPTH`` without parsing it: strings are cut out and the depth
after each bracket left is summed up, by C loops, in a third of the time the parser takes (a
body with no more brackets than the limit, nearly every request, is only counted).
"""

from __future__ import annotations

import itertools
import json
import operator
import re
from typing import Any

#: The deepest nesting of arrays and objects a client's JSON may have (a tensor's nested
#: lists are as deep as its rank, plus two or three levels around them).
MAX_JSON_DEPTH = 100

#: A JSON string, escapes included (the brackets inside it are not structure).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
#: Every byte but a bracket; an opening bracket as 2, a closing one as 0.
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEPS = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")


class JsonTooDeep(ValueError):
    """The document is nested deeper than the limit."""


def check_depth(data: bytes | bytearray | str, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise JsonTooDeep when ``data`` nests arrays and objects deeper than ``limit`` levels
    (counting opening brackets that never close, which the parser would recurse into too)."""
    if isinstance(data, str):
        raw: bytes | bytearray = data.encode("utf-8", "surrogatepass")
    else:
        raw = data
        encoding = json.detect_encoding(raw)  # as json.loads reads it: UTF-16 and -32 too
        if encoding not in ("utf-8", "utf-8-sig"):
            try:
                raw = raw.decode(encoding).encode("utf-8", "surrogatepass")
            except UnicodeDecodeError:
                return  # the parser refuses it as it is, reading nothing deep
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return
    # Each bracket as its step: an opening one +1, a closing one -1 (as 2 and 0, less the
    # count of brackets so far); the deepest prefix is the deepest level the parser reaches.
    if b'"' in raw:
        raw = _STRING.sub(b"", raw)
    steps = raw.translate(_STEPS, _NOT_BRACKETS)
    deepest = max(map(operator.sub, itertools.accumulate(steps), itertools.count(1)))
    if deepest > limit:
        raise JsonTooDeep(f"nested deeper than {limit} levels")


def loads(data: bytes | bytearray | str, limit: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` of a client's document, its depth checked first: ValueError when it is
    not JSON, JsonTooDeep (a ValueError) when it is nested deeper than ``limit``."""
    check_depth(data, limit)
    return json.loads(data)
