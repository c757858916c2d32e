"""A client's JSON is refused by its nesting before it is parsed (protos/json_limits.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest

from protos.json_limits import MAX_JSON_DEPTH, JsonTooDeep, check_depth, loads

LIMIT = MAX_JSON_DEPTH


def _nested(depth: int, opening: str = "[", closing: str = "]") -> str:
    return opening * depth + closing * depth


@pytest.mark.parametrize("document", [
    _nested(LIMIT),
    '{"a":' * LIMIT + "1" + "}" * LIMIT,
    "[" + ",".join([_nested(LIMIT - 1)] * 50) + "]",   # wide, each exactly at the limit
    '["' + "[" * 5000 + '"]',                            # brackets inside a string
    '["\\"' + "[" * 5000 + '"]',                         # ... after an escaped quote
    json.dumps([[i, "x]y{", [i]] for i in range(5000)]),  # many brackets, shallow
    "]" * 5000 + "[" * LIMIT,                            # the parser stops at the first ]
])
def test_documents_within_the_limit_pass(document: str) -> None:
    check_depth(document)
    check_depth(document.encode())


@pytest.mark.parametrize("document", [
    _nested(LIMIT + 1),
    "[" * 50_000,                                        # never closed: the parser recurses
    _nested(50_000),
    '{"a":' * (LIMIT + 1) + "1" + "}" * (LIMIT + 1),
    "[" + "[1]," * 5000 + _nested(LIMIT) + "]",          # one deep branch among shallow ones
    '["' + "[" * 10 + '",' + _nested(LIMIT + 1) + "]",
    '{"k":[' * 60 + "0" + "]}" * 60,                     # objects and arrays together
])
def test_documents_deeper_than_the_limit_are_refused(document: str) -> None:
    with pytest.raises(JsonTooDeep, match=f"nested deeper than {LIMIT} levels"):
        check_depth(document.encode())
    with pytest.raises(ValueError):  # JsonTooDeep is a ValueError: callers' 400 path
        loads(document)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32-be"])
def test_documents_in_the_other_encodings_json_reads_are_checked_too(encoding: str) -> None:
    # A string whose escaped quote would end it early, read byte by byte.
    hiding = '["\\"' + "]" * 5 + '", ' + _nested(LIMIT + 1) + "]"
    for document in (_nested(LIMIT + 1), hiding):
        with pytest.raises(JsonTooDeep):
            check_depth(document.encode(encoding))
    check_depth(_nested(LIMIT).encode(encoding))
    assert loads('{"a": [1]}'.encode(encoding)) == {"a": [1]}


def test_loads_parses_what_it_admits() -> None:
    assert loads(b'{"instances": [[1, 2], [3]]}') == {"instances": [[1, 2], [3]]}
    with pytest.raises(ValueError):
        loads(b"[1,")


def _best_of_three_s(work: Callable[[], object]) -> float:
    times = []
    for _ in range(3):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def test_the_check_costs_less_than_parsing() -> None:
    """The worst case for the check (every byte a bracket, each branch at the limit) is
    checked in less time than the parser takes over the same bytes."""
    worst = ("[" + ",".join([_nested(LIMIT - 1)] * 5_000) + "]").encode()
    checked_s = _best_of_three_s(lambda: check_depth(worst))
    parsed_s = _best_of_three_s(lambda: json.loads(worst))
    assert checked_s < parsed_s, (checked_s, parsed_s)
