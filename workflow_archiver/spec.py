"""A workflow spec, read and checked as TorchServe 0.12 reads it (``ensemble/WorkFlow.java``,
``Dag.java``, ``DagExecutor.java``), into typed, frozen values.

The spec is YAML with two sections::

    models:
      min-workers: 1          # global settings: they apply to the model sections after them
      batch-size: 4
      m1:
        url: m1.mar           # an archive in the model store, or a URL
        batch-size: 8         # a model's own settings win over the global ones
    dag:
      pre: [m1, m2]           # node -> its children; [] (or only blanks) for a leaf
      m1: [post]
      m2: [post]

What TorchServe does with it, and so what this module returns:

- **Nodes.** Every name in ``dag`` (a key, or in a list of children) is a node. A node whose
  name is a model section of ``models`` is a *model* node; any other is a *function* node: the
  function of that name in the workflow's handler file. Model sections that no node names are
  not registered (``WorkflowSpec.unused_models``; a warning).
- **Names.** Each node is registered as a model named ``<workflow>__<node>`` (two
  underscores), function nodes too; that is the name ``GET /models`` lists.
- **Settings** (``NodeSettings``; TorchServe's defaults in brackets): ``min-workers`` [1],
  ``max-workers`` [1], ``batch-size`` [1], ``max-batch-delay`` [50 ms], ``retry-attempts`` [1],
  ``timeout-ms`` [10000]. Values are integers (TorchServe casts them to Java ``int``: a string,
  a float or a bool is a ``ClassCastException`` there, an error here). TorchServe reads the
  ``models`` mapping in order, so a global key applies to the model sections *after* it only
  (a warning says when one comes late). A function node gets ``min-workers`` 1, ``max-workers``
  1, ``batch-size`` 1 and ``max-batch-delay`` 0 whatever the spec says, and the final global
  ``retry-attempts`` and ``timeout-ms``. TorchServe starts ``max-workers`` workers for a node
  (it passes it as the model's initial workers) and never reads ``min-workers``.
- **Retries and time-outs**, per node and per request: each attempt waits ``timeout-ms``; a
  failed or timed-out attempt is retried while fewer than ``retry-attempts`` retries were made,
  so a node runs at most ``retry-attempts + 1`` times. The last failure fails the workflow
  request with 500 and "Error executing <node>" (TorchServe's message, after its "Failed to
  execute workflow Node after <n> attempts : ").
- **Data between nodes.** The root gets the request's inputs (its parameters: ``body``,
  ``data``, form fields) and headers. A node with one parent gets that parent's output bytes as
  one input named ``body``; a node with several parents gets one input per parent, named after
  the parent node (``NodeSpec.input_name``). Every node sees the request's headers. The
  outputs of the leaves answer the request: one leaf's output as it is (TorchServe says
  ``Content-Type: application/json`` whatever it is), several leaves' as one JSON object
  keyed by leaf name, each output parsed as a JSON object.
- **Shape of the DAG** (TorchServe's ``InvalidDAGException``, 400 at registration): exactly
  one start node ("DAG should have only one start node"), no node its own child ("Self loop
  exception"), no edge listed twice ("loop exception"), and no cycle ("Not a valid DAG").

TorchServe reports every other fault of shape as a ``NullPointerException`` or
``ClassCastException`` (500) or as a node that fails to register; ``SpecError`` says instead
which section, node and key. Beyond TorchServe, a setting must make sense (``batch-size`` and
``max-workers`` at least 1, ``timeout-ms`` at least 1, ``retry-attempts`` at most
``MAX_RETRY_ATTEMPTS``, the others not negative), a node's
model name must be a valid model name, a function node's name a Python identifier, and a
model's ``url`` may not contain ``..`` (TorchServe refuses such a URL when it registers the
model: "Relative path is not allowed in url"). With ``functions`` (the names the handler file
defines, ``handler_names``), a function node the handler lacks is an error too.

A spec is its author's input to the server, so it is read within bounds: at most
``MAX_SPEC_BYTES``, by ``model_archiver.yaml_files`` (aliases that expand it more than a few
times, nesting beyond 64 levels, refused), with at most ``MAX_NODES`` nodes, and every
message quotes no more than a short, escaped excerpt of it (``model_archiver.quoting``).
"""

from __future__ import annotations

import ast
import keyword
from collections import deque
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any

from model_archiver import names
from model_archiver.paths import climbs
from model_archiver.quoting import excerpt, quoted
from model_archiver.yaml_files import YamlError, load_yaml
from workflow_archiver.errors import InvalidDAGError, SpecError, WorkflowArchiverError

__all__ = [
    "FUNCTION_NODE_SETTINGS",
    "MAX_NODES",
    "MAX_SPEC_BYTES",
    "MODEL_NAME_SEPARATOR",
    "SETTING_KEYS",
    "NodeKind",
    "NodeSettings",
    "NodeSpec",
    "WorkflowSpec",
    "handler_names",
    "load_spec",
    "model_name",
    "parse_spec",
]

MODEL_NAME_SEPARATOR = "__"
"""Between the workflow's name and a node's in the node's model name (``wf__m1``)."""
MAX_SPEC_BYTES = 64 * 1024
"""A spec is a few hundred bytes; a bigger one is refused before YAML reads it."""
MAX_NODES = 100
"""The most nodes a DAG may have: each is a model of its own, with its own workers."""
_INT_MIN, _INT_MAX = -(1 << 31), (1 << 31) - 1  # Java's int, which TorchServe casts to


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """A node's settings; the defaults are TorchServe's."""

    min_workers: int = 1
    """``min-workers``: TorchServe reads it and does nothing with it."""
    max_workers: int = 1
    """``max-workers``: the workers TorchServe starts for the node's model."""
    batch_size: int = 1
    """``batch-size``: the node's model's batch size."""
    max_batch_delay_ms: int = 50
    """``max-batch-delay``: how long a batch waits to fill, in milliseconds."""
    retry_attempts: int = 1
    """``retry-attempts``: retries after a failed or timed-out attempt (so at most
    ``retry_attempts + 1`` attempts)."""
    timeout_ms: int = 10_000
    """``timeout-ms``: how long one attempt at the node may take, in milliseconds."""


SETTING_KEYS: Mapping[str, str] = MappingProxyType({
    "min-workers": "min_workers",
    "max-workers": "max_workers",
    "batch-size": "batch_size",
    "max-batch-delay": "max_batch_delay_ms",
    "retry-attempts": "retry_attempts",
    "timeout-ms": "timeout_ms",
})
"""The spec's setting keys (global and per model) -> ``NodeSettings`` fields."""
_MINIMUM = {"min_workers": 0, "max_workers": 1, "batch_size": 1, "max_batch_delay_ms": 0,
            "retry_attempts": 0, "timeout_ms": 1}
#: Beyond TorchServe (which takes any int): a node failing without a client deadline was retried
#: up to 2**31 times, each a warning line, before its request was answered.
MAX_RETRY_ATTEMPTS = 100
_MAXIMUM = {"retry_attempts": MAX_RETRY_ATTEMPTS}
assert set(_MINIMUM) == {f.name for f in fields(NodeSettings)} == set(SETTING_KEYS.values())

FUNCTION_NODE_SETTINGS = NodeSettings(min_workers=1, max_workers=1, batch_size=1,
                                      max_batch_delay_ms=0)
"""What TorchServe gives every function node, but for ``retry_attempts`` and ``timeout_ms``,
which come from the spec's global settings."""


class NodeKind(str, Enum):
    """What runs at a node."""

    MODEL = "model"
    """A model archive, named in the spec's ``models`` section."""
    FUNCTION = "function"
    """A function of the workflow's handler file, called as ``function(data, context)``."""


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One node of the DAG."""

    name: str
    """The node's name in the spec: a model section's name, or the handler's function's."""
    kind: NodeKind
    model_name: str
    """The model it is registered as: ``<workflow>__<node>``."""
    url: str | None
    """A model node's archive (``url``: a name in the model store or a URL); None for a
    function node."""
    settings: NodeSettings
    parents: tuple[str, ...]
    """The nodes whose outputs are this node's inputs, in the order the spec adds the edges."""
    children: tuple[str, ...]
    """The nodes this node's output goes to, in the spec's order."""

    @property
    def is_model(self) -> bool:
        return self.kind is NodeKind.MODEL

    @property
    def is_function(self) -> bool:
        return self.kind is NodeKind.FUNCTION

    def input_name(self, parent: str) -> str:
        """The name under which ``parent``'s output reaches this node: ``body`` when it is
        the only parent, else the parent's node name (TorchServe's ``DagExecutor``)."""
        if parent not in self.parents:
            raise ValueError(f"{parent!r} is not a parent of node {self.name!r}")
        return "body" if len(self.parents) == 1 else parent


@dataclass(frozen=True)
class WorkflowSpec:
    """A checked workflow spec: its nodes, how they connect, and their settings."""

    workflow_name: str
    nodes: Mapping[str, NodeSpec]
    """Every node by name, in topological order (a read-only mapping)."""
    order: tuple[str, ...]
    """The node names in a topological order: each after all its parents, and otherwise in
    the order the spec first names them."""
    root: str
    """The one start node: it gets the request's inputs."""
    leaves: tuple[str, ...]
    """The nodes without children, in ``order``: their outputs answer the request."""
    settings: NodeSettings
    """The global settings as the end of the ``models`` section leaves them."""
    unused_models: tuple[str, ...] = ()
    """Model sections that no node names: TorchServe does not register them."""
    warnings: tuple[str, ...] = ()
    """What TorchServe silently ignores or reads surprisingly in this spec, for the user."""

    def __getitem__(self, name: str) -> NodeSpec:
        return self.nodes[name]

    def __iter__(self) -> Iterator[NodeSpec]:
        return iter(self.nodes.values())

    @property
    def models(self) -> tuple[NodeSpec, ...]:
        """The model nodes, in ``order``."""
        return tuple(node for node in self if node.is_model)

    @property
    def functions(self) -> tuple[NodeSpec, ...]:
        """The function nodes, in ``order``."""
        return tuple(node for node in self if node.is_function)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every model the workflow registers (function nodes' too), in ``order``."""
        return tuple(node.model_name for node in self)


def model_name(workflow_name: str, node: str) -> str:
    """The name TorchServe registers a workflow's node under."""
    return f"{workflow_name}{MODEL_NAME_SEPARATOR}{node}"


def load_spec(path: Path, workflow_name: str, *,
              functions: Collection[str] | None = None) -> WorkflowSpec:
    """Read and check the spec file at ``path`` (see ``parse_spec``)."""
    try:
        with Path(path).open("rb") as stream:
            text = stream.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise SpecError(f"cannot read workflow spec {path}: {exc}") from exc
    return parse_spec(text, workflow_name, functions=functions)


def parse_spec(text: str | bytes, workflow_name: str, *,
               functions: Collection[str] | None = None) -> WorkflowSpec:
    """Read a workflow spec's text and check it as TorchServe does (see the module's text).

    ``workflow_name`` names the node models (``<workflow>__<node>``). ``functions``, when
    given, holds the names the handler file defines: a function node missing from it is an
    error ("unknown node"). Raises ``SpecError``, or its ``InvalidDAGError`` for the faults
    TorchServe reports as ``InvalidDAGException``.
    """
    problem = names.name_problem(workflow_name, "workflow name")
    if problem:
        raise SpecError(problem)
    if len(text) > MAX_SPEC_BYTES:  # a str's length in characters: checked again in bytes
        raise SpecError(f"workflow spec is over {MAX_SPEC_BYTES} bytes")
    try:
        document = load_yaml(text, max_bytes=MAX_SPEC_BYTES)
    except YamlError as exc:
        raise SpecError(f"Failed to parse yaml: {exc}") from None
    if not isinstance(document, dict):
        raise SpecError(f"workflow spec must be a mapping with 'models' and 'dag', "
                        f"got {_kind(document)}")
    warnings: list[str] = []
    unknown = sorted(str(key) for key in document if key not in ("models", "dag"))
    if unknown:
        warnings.append(f"top-level keys {quoted(unknown)} are ignored (only 'models' and "
                        f"'dag' mean something)")
    models, final = _read_models(document.get("models"), warnings)
    edges, mentioned = _read_dag(document.get("dag"))
    return _build(workflow_name, models, final, edges, mentioned, functions, warnings)


@dataclass(frozen=True, slots=True)
class _Model:
    url: str | None
    settings: NodeSettings


def _read_models(section: object, warnings: list[str]
                 ) -> tuple[dict[str, _Model], NodeSettings]:
    """The model sections by name, and the global settings the section ends with."""
    if section is None:
        raise SpecError("workflow spec has no 'models' section (write 'models: {}' for a "
                        "workflow of functions only)")
    if not isinstance(section, dict):
        raise SpecError(f"'models' must be a mapping, got {_kind(section)}")
    current = NodeSettings()
    models: dict[str, _Model] = {}
    for key, value in section.items():
        if not isinstance(key, str) or not key:
            raise SpecError(f"'models': {quoted(key)} is not a model name or a setting key")
        if key in SETTING_KEYS:
            current = replace(current, **{SETTING_KEYS[key]: _setting(value, key, "models")})
            if models:
                warnings.append(
                    f"models.{key} comes after model {quoted(next(reversed(models)))}: as in "
                    f"TorchServe, it applies only to the models listed after it")
            continue
        section_name = f"models.{excerpt(key)}"
        if not isinstance(value, dict):
            raise SpecError(f"{section_name} must be a mapping with 'url' and settings, "
                            f"got {_kind(value)}")
        overrides = {}
        for own_key, own_value in value.items():
            if own_key in SETTING_KEYS:
                overrides[SETTING_KEYS[own_key]] = _setting(own_value, own_key, section_name)
            elif own_key != "url":
                warnings.append(f"{section_name}.{excerpt(str(own_key))} is ignored "
                                f"(TorchServe reads only 'url' and {', '.join(SETTING_KEYS)})")
        url = value.get("url")
        if url is not None and not isinstance(url, str):
            raise SpecError(f"{section_name}.url must be a string, got {_kind(url)}")
        models[key] = _Model(url, replace(current, **overrides))
    return models, current


def _setting(value: object, key: str, section: str) -> int:
    where = f"{section}.{key}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where} must be an integer, got {_kind(value)}")
    field_name = SETTING_KEYS[key]
    most = _MAXIMUM.get(field_name, _INT_MAX)
    if not _INT_MIN <= value <= _INT_MAX or value > most:
        raise SpecError(f"{where} = {quoted(value)} is out of range: it must be from "
                        f"{_MINIMUM[field_name]} to {most}")
    if value < _MINIMUM[field_name]:
        raise SpecError(f"{where} = {value}: it must be at least {_MINIMUM[field_name]}")
    return value


def _read_dag(section: object) -> tuple[list[tuple[str, str]], list[str]]:
    """The edges in the spec's order, and every node in the order the spec first names it."""
    if section is None:
        raise SpecError("workflow spec has no 'dag' section")
    if not isinstance(section, dict):
        raise SpecError(f"'dag' must be a mapping of node -> [children], got {_kind(section)}")
    edges: dict[tuple[str, str], None] = {}  # a dict: in order, and a quick membership test
    mentioned: dict[str, None] = {}
    for node, children in section.items():
        if not isinstance(node, str) or not node.strip():
            raise SpecError(f"dag: {quoted(node)} is not a node name")
        _mention(mentioned, node)
        where = f"dag.{excerpt(node)}"
        if children is None:
            raise SpecError(f"{where} has no list of children (write [] for a leaf)")
        if not isinstance(children, list):
            raise SpecError(f"{where} must be a list of nodes, got {_kind(children)} "
                            f"(write [{excerpt(str(children))}] for one child)")
        for child in children:
            if child is None or (isinstance(child, str) and not child.strip()):
                continue  # TorchServe skips null and blank entries
            if not isinstance(child, str):
                raise SpecError(f"{where}: {quoted(child)} is not a node name")
            if child == node:
                raise InvalidDAGError(f"Self loop exception: node {quoted(node)} is its own "
                                      f"child")
            if (node, child) in edges:
                raise InvalidDAGError(f"loop exception: the edge {excerpt(node)} -> "
                                      f"{excerpt(child)} is listed twice")
            _mention(mentioned, child)
            edges[node, child] = None
    return list(edges), list(mentioned)


def _mention(mentioned: dict[str, None], node: str) -> None:
    """Count ``node`` in; a DAG of more than ``MAX_NODES`` nodes is refused as it grows."""
    mentioned.setdefault(node)
    if len(mentioned) > MAX_NODES:
        raise SpecError(f"the dag has more than {MAX_NODES} nodes (each node is a model "
                        f"with workers of its own)")


def _build(workflow_name: str, models: dict[str, _Model], final: NodeSettings,
           edges: list[tuple[str, str]], mentioned: list[str],
           functions: Collection[str] | None, warnings: list[str]) -> WorkflowSpec:
    parents: dict[str, list[str]] = {name: [] for name in mentioned}
    children: dict[str, list[str]] = {name: [] for name in mentioned}
    for parent, child in edges:
        parents[child].append(parent)
        children[parent].append(child)
    starts = [name for name in mentioned if not parents[name]]
    if len(starts) != 1:
        found = ", ".join(map(excerpt, starts)) if starts else "none: every node has a parent"
        raise InvalidDAGError(f"DAG should have only one start node (found {found})")
    order = _topological_order(starts[0], parents, children)
    if len(order) != len(mentioned):
        ordered = set(order)
        stuck = [excerpt(name) for name in mentioned if name not in ordered]
        raise InvalidDAGError(f"Not a valid DAG: a cycle runs through {', '.join(stuck)}")

    function_settings = replace(FUNCTION_NODE_SETTINGS, retry_attempts=final.retry_attempts,
                                timeout_ms=final.timeout_ms)
    nodes: dict[str, NodeSpec] = {}
    missing: list[str] = []
    for name in order:
        registered = model_name(workflow_name, name)
        problem = names.name_problem(registered)
        if problem:
            raise SpecError(f"dag node {quoted(name)}: its model would be named "
                            f"{quoted(registered)}: {problem}")
        model = models.get(name)
        if model is not None:
            if not model.url:
                raise SpecError(f"models.{name} has no 'url' (the model archive to serve)")
            if climbs(model.url):
                raise SpecError(f"models.{name}.url {quoted(model.url)}: Relative path is "
                                f"not allowed in url")
            kind, url, settings = NodeKind.MODEL, model.url, model.settings
        else:
            if not name.isidentifier() or keyword.iskeyword(name):
                raise SpecError(f"dag node {quoted(name)} is not in 'models', so it is a "
                                f"function of the handler file, but it is not a Python "
                                f"identifier")
            if functions is not None and name not in functions:
                missing.append(name)
            kind, url, settings = NodeKind.FUNCTION, None, function_settings
        nodes[name] = NodeSpec(name=name, kind=kind, model_name=registered, url=url,
                               settings=settings, parents=tuple(parents[name]),
                               children=tuple(children[name]))
    if missing:
        raise SpecError(
            f"unknown node{'s' if len(missing) > 1 else ''} {', '.join(map(quoted, missing))}: "
            f"neither a model of 'models' nor a function of the handler file")
    unused = tuple(name for name in models if name not in nodes)
    if unused:
        warnings.append(f"models {quoted(list(unused))} are in no node of 'dag': TorchServe "
                        f"does not register them")
    return WorkflowSpec(
        workflow_name=workflow_name, nodes=MappingProxyType(nodes), order=tuple(order),
        root=order[0], leaves=tuple(name for name in order if not children[name]),
        settings=final, unused_models=unused, warnings=tuple(warnings))


def _topological_order(root: str, parents: dict[str, list[str]],
                       children: dict[str, list[str]]) -> list[str]:
    """Kahn's algorithm from the root; children join the queue in the spec's order."""
    waiting = {name: len(node_parents) for name, node_parents in parents.items()}
    queue, order = deque([root]), []
    while queue:
        name = queue.popleft()
        order.append(name)
        for child in children[name]:
            waiting[child] -= 1
            if waiting[child] == 0:
                queue.append(child)
    return order


def handler_names(source: str | bytes, filename: str = "<handler>") -> frozenset[str] | None:
    """The names a handler file binds at its top level (functions, classes, assignments,
    imports), read without running it; None when it cannot tell (``from x import *``).

    Raises ``WorkflowArchiverError`` when the file is not valid Python.
    """
    try:
        tree = ast.parse(source, filename)
    except (SyntaxError, ValueError) as exc:
        raise WorkflowArchiverError(f"handler file {filename} is not valid Python: {exc}") \
            from exc
    except (RecursionError, MemoryError):
        raise WorkflowArchiverError(f"handler file {filename} nests its expressions too "
                                    f"deeply to be read") from None
    found: set[str] = set()
    for node in _top_level(tree.body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    return None
                found.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                found.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return frozenset(found)


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run at import time, into ``if``/``try``/``with`` blocks."""
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.With | ast.AsyncWith):
            yield from _top_level(node.body)
            yield from _top_level(getattr(node, "orelse", []))
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody,
                          *(handler.body for handler in node.handlers)):
                yield from _top_level(block)


def _kind(value: Any) -> str:
    return "nothing" if value is None else f"{type(value).__name__} {quoted(value)}"
