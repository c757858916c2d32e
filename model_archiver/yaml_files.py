"""The YAML files archives carry (a .mar's model-config.yaml, a .war's spec), read within
bounds: whoever registers an archive wrote them.

``yaml.safe_load`` builds no objects but plain ones, yet it has no bound on what a small file
becomes: aliases let 2 kB stand for a billion-item tree (a "billion laughs"), which whoever
walks, prints or serialises it then pays for in time and memory; nesting a few thousand deep
overflows its recursive composer (``RecursionError``); and some scalars fail with other
errors than ``YAMLError`` (an integer beyond Python's digit limit). ``load_yaml`` reads with
the same safe constructors, but refuses, with a ``YamlError`` that quotes no more than an
excerpt of the input:

* a text over ``max_bytes`` (``MAX_YAML_BYTES``: 1 MiB), before it is parsed;
* a document whose size once every alias is expanded (each node counts 1, each scalar also
  its length) exceeds ``EXPANSION_FACTOR`` times ``max_bytes``: an alias-free document never
  comes near it, so aliases stay usable for what they are for, repeating a section;
* an alias of a collection inside itself (a recursive document, which no reader expects);
* nesting deeper than ``MAX_DEPTH`` (SnakeYAML, TorchServe's reader, stops at 50).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from model_archiver.quoting import excerpt

__all__ = ["EXPANSION_FACTOR", "MAX_DEPTH", "MAX_YAML_BYTES", "YamlError", "load_yaml",
           "read_yaml"]

MAX_YAML_BYTES = 1 << 20
EXPANSION_FACTOR = 4
MAX_DEPTH = 64
#: How much of a YAML error's text (its context and problem) a message keeps.
_MAX_ERROR_CHARS = 200


class YamlError(yaml.YAMLError):
    """The text is not YAML, or is YAML beyond the bounds; the message is short and escaped."""


class _BoundedLoader(yaml.SafeLoader):
    """``SafeLoader`` counting, as it composes, the expanded size of every node (an alias
    costs its anchor's whole size again) and the depth."""

    def __init__(self, stream: str | bytes, budget: int, max_depth: int) -> None:
        super().__init__(stream)
        self._budget = budget
        self._max_depth = max_depth
        self._used = 0
        self._depth = 0
        #: Each composed node's expanded size; an anchor still being composed has none yet.
        self._sizes: dict[yaml.Node, int] = {}

    def _spend(self, units: int) -> None:
        self._used += units
        if self._used > self._budget:
            raise YamlError(f"the document expands to more than {self._budget} nodes and "
                            "characters (aliases repeat too much of it)")

    def fetch_flow_collection_start(self, TokenClass: type[yaml.Token]) -> None:
        # NOTE: checked as the scanner meets each '[' or '{', before the composer sees a
        # node: the scanner's own work per token grows with the flow depth.
        if self.flow_level >= self._max_depth:
            raise YamlError(_too_deep(self._max_depth))
        super().fetch_flow_collection_start(TokenClass)

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            node = super().compose_node(parent, index)
            size = None if node is None else self._sizes.get(node)
            if size is None:
                raise YamlError("an alias refers to a collection that contains it (a "
                                "recursive document)")
            self._spend(size)
            return node
        self._depth += 1
        if self._depth > self._max_depth:
            raise YamlError(_too_deep(self._max_depth))
        start = self._used
        self._spend(1)
        node = super().compose_node(parent, index)
        if isinstance(node, yaml.ScalarNode):
            self._spend(len(node.value))
        if node is not None:
            self._sizes[node] = self._used - start
        self._depth -= 1
        return node


def load_yaml(text: str | bytes, *, max_bytes: int = MAX_YAML_BYTES,
              max_depth: int = MAX_DEPTH) -> Any:
    """The one document of ``text`` as ``yaml.safe_load`` reads it, within the bounds (see
    the module); ``YamlError`` otherwise."""
    size = len(text) if isinstance(text, bytes) else len(text.encode("utf-8", "replace"))
    if size > max_bytes:
        raise YamlError(f"the document is {size} bytes, over the limit of {max_bytes}")
    loader: _BoundedLoader | None = None
    try:
        loader = _BoundedLoader(text, EXPANSION_FACTOR * max_bytes, max_depth)
        return loader.get_single_data()
    except YamlError:
        raise
    except yaml.MarkedYAMLError as exc:
        raise YamlError(_marked(exc)) from None
    except yaml.YAMLError as exc:
        raise YamlError(excerpt(str(exc), _MAX_ERROR_CHARS)) from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        # A scalar the safe constructors cannot build (an integer of 5,000 digits, a
        # timestamp of month 13, ...).
        raise YamlError(f"a value cannot be read: {excerpt(str(exc), _MAX_ERROR_CHARS)}"
                        ) from None
    finally:
        if loader is not None:
            loader.dispose()


def read_yaml(path: Path, *, max_bytes: int = MAX_YAML_BYTES) -> Any:
    """The YAML file at ``path`` (``load_yaml``), never reading more than ``max_bytes`` + 1
    bytes of it. ``OSError`` when it cannot be read."""
    with path.open("rb") as stream:
        data = stream.read(max_bytes + 1)
    return load_yaml(data, max_bytes=max_bytes)


def _too_deep(max_depth: int) -> str:
    return f"the document nests deeper than {max_depth} levels"


def _marked(error: yaml.MarkedYAMLError) -> str:
    """One line: what the parser was doing, what it found, and where."""
    parts = [excerpt(part, _MAX_ERROR_CHARS) for part in (error.context, error.problem) if part]
    mark = error.problem_mark or error.context_mark
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return (", ".join(parts) or "not valid YAML") + where
