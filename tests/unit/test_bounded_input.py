"""Issue 31: what archives and clients send, read and quoted within bounds.

``model_archiver.yaml_files`` reads the YAML files archives carry (a workflow's spec, a .mar's
model-config.yaml) with ``yaml.safe_load``'s constructors but bounded size, expansion and
depth; ``model_archiver.quoting`` is how every message quotes client input; ``ServeError``
caps any message. The spec reader (``workflow_archiver.spec``) is bounded through both.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from frontend.errors import MAX_MESSAGE_CHARS, BadRequest, excerpt, quoted
from model_archiver.yaml_files import MAX_DEPTH, YamlError, load_yaml, read_yaml
from workflow_archiver import SpecError, WorkflowArchiverError
from workflow_archiver.spec import MAX_NODES, MAX_SPEC_BYTES, handler_names, parse_spec


def laughs(levels: int, width: int = 9) -> str:
    """Each anchor lists the one before ``width`` times: ``width**(levels + 1)`` strings."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]"
              for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


# ---- the YAML reader -------------------------------------------------------------------------


def test_plain_yaml_and_modest_aliases_read_as_safe_load_reads_them() -> None:
    text = "base: &base {batchSize: 4, handler: {x: [1, 2]}}\nother:\n  <<: *base\n  y: 1\n"
    assert load_yaml(text) == {"base": {"batchSize": 4, "handler": {"x": [1, 2]}},
                               "other": {"batchSize": 4, "handler": {"x": [1, 2]}, "y": 1}}
    assert load_yaml("") is None and load_yaml(b"a: 1") == {"a": 1}
    nested = "a: " + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1)
    assert load_yaml(nested) is not None


@pytest.mark.parametrize(("text", "why"), [
    (laughs(9), "the document expands to more than"),
    # Merges count too: one large mapping merged into many.
    ("big: &big {" + ", ".join(f"k{i}: {i}" for i in range(2000)) + "}\n"
     + "".join(f"m{i}: {{<<: *big}}\n" for i in range(2000)), "expands to more than"),
    # One long string repeated: few nodes, many characters.
    ("s: &s " + "x" * 60_000 + "\nl: [" + ", ".join(["*s"] * 80) + "]\n", "expands"),
    ("a: &a [1, *a]\n", "recursive document"),
    ("a: " + "[" * 100_000, "nests deeper than 64 levels"),
    ("a: " + "{b: " * 100_000, "nests deeper than 64 levels"),
    ("".join(" " * i + f"k{i}:\n" for i in range(200)), "nests deeper than 64 levels"),
    ("- " * 100_000 + "x", "nests deeper than 64 levels"),
    ("a: " + "1" * 5000, "a value cannot be read"),
    ("a: 2024-13-40", "a value cannot be read"),
    ("a: !!python/object/apply:os.system [echo]", "could not determine a constructor"),
    ("a: *" + "n" * 50_000, "found undefined alias"),
    ("a: \x00", "unacceptable character"),
    ("---\na: 1\n---\nb: 2\n", "expected a single document"),
    ("x" * ((1 << 20) + 1), "over the limit of 1048576"),
])
def test_what_would_blow_up_is_a_short_yaml_error(text: str, why: str) -> None:
    started = time.monotonic()
    with pytest.raises(YamlError, match=why) as raised:
        load_yaml(text)
    assert len(str(raised.value)) < 400, str(raised.value)
    assert "\x00" not in str(raised.value) and "\n" not in str(raised.value)
    assert time.monotonic() - started < 5


def test_read_yaml_reads_no_more_than_its_limit(tmp_path: Path) -> None:
    path = tmp_path / "model-config.yaml"
    path.write_text("batchSize: 4\n" + "#" * 5000)
    assert read_yaml(path) == {"batchSize": 4}
    with pytest.raises(YamlError, match="over the limit of 100"):
        read_yaml(path, max_bytes=100)


# ---- quoting ---------------------------------------------------------------------------------


def test_quoted_is_repr_of_at_most_a_short_excerpt() -> None:
    assert quoted("abc") == "'abc'" and quoted(12) == "12" and quoted(None) == "None"
    assert quoted("\x1b[31mred\n") == "'\\x1b[31mred\\n'"
    assert quoted("A" * 20_000_000) == "'" + "A" * 100 + "'... (20000000 characters)"
    assert quoted(b"\x00" * 500).endswith("... (500 bytes)")
    assert len(quoted("\U0010ffff" * 10_000)) < 1200  # escapes may lengthen, not unboundedly
    assert len(quoted(10 ** 4299)) <= 100


def test_quoted_walks_only_a_few_items_and_levels_of_a_container() -> None:
    shared = ["lol"] * 9
    for _ in range(12):  # 9**13 strings if walked
        shared = [shared] * 9
    started = time.monotonic()
    shown = quoted(shared)
    assert time.monotonic() - started < 1 and len(shown) <= 103
    loop: list[object] = []
    loop.append(loop)
    assert len(quoted(loop)) <= 103
    assert quoted({"a": 1, "b": [1, 2]}) == "{'a': 1, 'b': [1, 2]}"


def test_excerpt_keeps_short_printable_text_and_escapes_the_rest() -> None:
    assert excerpt("Model not found: my-model") == "Model not found: my-model"
    assert excerpt("wf\x1b]0;x\x07") == "wf\\x1b]0;x\\x07"
    assert excerpt("n" * 101) == "n" * 100 + "... (101 characters)"
    assert excerpt("é ünïcode") == "é ünïcode"


def test_no_error_message_is_longer_than_the_cap() -> None:
    error = BadRequest("x" * (MAX_MESSAGE_CHARS * 3))
    assert len(error.message) < MAX_MESSAGE_CHARS + 60
    assert error.message.endswith(f"(cut: the message was {MAX_MESSAGE_CHARS * 3} characters)")
    assert BadRequest("short").message == "short"


# ---- the spec reader -------------------------------------------------------------------------


def test_a_spec_bomb_is_refused_in_milliseconds_with_a_short_message() -> None:
    for text in (laughs(9) + "models: {}\ndag:\n  pre: *l9\n",
                 "models: {}\ndag:\n  pre: &c [" + ", ".join(["[x]"] * 50) + "]\n"
                 + "".join(f"  n{i}: *c\n" for i in range(50))):
        started = time.monotonic()
        with pytest.raises(SpecError) as raised:
            parse_spec(text, "wf")
        assert time.monotonic() - started < 1
        assert len(str(raised.value)) < 400, str(raised.value)


@pytest.mark.parametrize(("text", "message"), [
    ("models: {}\ndag:\n  pre: [" + ", ".join(f"f{i}" for i in range(MAX_NODES)) + "]\n",
     f"more than {MAX_NODES} nodes"),
    ("models:\n  batch-size: 4294967296\ndag:\n  pre: [m1]\n",
     "batch-size = 4294967296 is out of range: it must be from 1 to 2147483647"),
    ("models:\n  ? " + "m" * 5000 + "\n  : nope\ndag:\n  pre: [m1]\n",
     r"models\.m{100}\.\.\. \(5000 characters\) must be a mapping"),
    ("models: {}\ndag:\n  pre: [" + "[" + "x, " * 3000 + "x]]\n", r"is not a node name"),
    ("models: {}\ndag:\n  pre: " + "p" * 10_000 + "\n", r"\(10000 characters\)\] for one"),
    ("x" * (MAX_SPEC_BYTES + 1), f"over {MAX_SPEC_BYTES} bytes"),
])
def test_spec_messages_quote_excerpts(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=message) as raised:
        parse_spec(text, "wf")
    assert len(str(raised.value)) < 600, str(raised.value)


def test_a_handler_nested_beyond_the_parser_is_an_archiver_error() -> None:
    with pytest.raises(WorkflowArchiverError, match="nests its expressions too deeply"):
        handler_names("x = " + "1+" * 200_000 + "1")
