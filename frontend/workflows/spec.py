"""A workflow's spec file (the YAML of a .war): its nodes, their settings, its DAG.

TorchServe 0.12's format (its ``WorkFlow``): ``models`` holds the global node settings
(``min-workers``, ``max-workers``, ``batch-size``, ``max-batch-delay``, ``retry-attempts``,
``timeout-ms``) and one entry per model node (its ``url`` and overrides); ``dag`` maps each
node to the nodes its output goes to. A DAG node that is not a model is a function of the
archive's handler file. Only nodes of the DAG are served (a model listed but not in the DAG
is not loaded, as in TorchServe).

What a function node is here: as TorchServe, one worker runs it and each call gets a list of
one request (TorchServe's functions often read ``data[0]`` only); its queue still gathers the
requests that wait while the worker is busy, so one round trip to the worker carries many
calls. A function also listed under ``models`` without a ``url`` (batchserve's extension; the
same entry makes TorchServe fail) takes whole batches instead, with that entry's settings.

``parse_spec`` is the one entry point; it raises InvalidWorkflow naming what is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import yaml

from frontend.errors import InvalidWorkflow

#: The global settings and TorchServe's defaults for them (docs/workflows.md, WorkFlow.java).
SETTING_KEYS = ("min-workers", "max-workers", "batch-size", "max-batch-delay",
                "retry-attempts", "timeout-ms")
#: Each spec key's NodeSettings field.
_FIELDS = {"min-workers": "min_workers", "max-workers": "max_workers",
           "batch-size": "batch_size", "max-batch-delay": "max_batch_delay_ms",
           "retry-attempts": "retry_attempts", "timeout-ms": "timeout_ms"}


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """How one node is served and called."""

    min_workers: int = 1
    max_workers: int = 1
    batch_size: int = 1
    max_batch_delay_ms: int = 50
    #: Calls after the first when a call fails or times out (TorchServe: 1, so two calls).
    retry_attempts: int = 1
    #: Each call's deadline.
    timeout_ms: int = 10000

    def with_values(self, values: Mapping[str, int]) -> NodeSettings:
        """These settings with the spec's keys (``batch-size``, ...) in ``values`` applied."""
        return replace(self, **{_FIELDS[key]: value for key, value in values.items()})


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One node of the DAG."""

    name: str
    #: The model archive of a model node; None for a function of the handler file.
    url: str | None
    settings: NodeSettings
    #: A function node that takes whole batches (listed under ``models`` without a url).
    batched: bool = False

    @property
    def is_function(self) -> bool:
        return self.url is None


@dataclass(frozen=True, slots=True)
class WorkflowSpec:
    """A parsed spec: the global settings, the DAG's nodes (in the order they first appear)
    and its edges as written (node -> the nodes it feeds)."""

    defaults: NodeSettings
    nodes: dict[str, NodeSpec]
    edges: dict[str, tuple[str, ...]]

    def dag_text(self) -> str:
        """The ``dag`` section as TorchServe's describe shows it (Java's Map.toString):
        ``{preprocessing=[m1], m1=[postprocessing]}``."""
        return "{" + ", ".join(f"{node}=[{', '.join(children)}]"
                               for node, children in self.edges.items()) + "}"


def _setting(where: str, key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidWorkflow(f"{where}: {key} must be an integer, got {value!r}")
    minimum = 1 if key in ("batch-size", "timeout-ms") else 0
    if value < minimum:
        raise InvalidWorkflow(f"{where}: {key} must be >= {minimum}, got {value}")
    return value


def _settings(where: str, entry: Mapping[str, object]) -> dict[str, int]:
    return {key: _setting(where, key, entry[key]) for key in SETTING_KEYS if key in entry}


def _node_name(where: str, name: object) -> str:
    if not isinstance(name, str) or not name.strip():
        raise InvalidWorkflow(f"{where}: a node name must be a non-empty string, got {name!r}")
    return name.strip()


def load_yaml(text: str) -> Mapping[str, Any]:
    """The spec file's YAML as a mapping."""
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidWorkflow(f"Failed to parse yaml: {exc}") from None
    if not isinstance(loaded, Mapping):
        raise InvalidWorkflow("the workflow spec must be a mapping with 'models' and 'dag'")
    return loaded


def parse_spec(text: str) -> WorkflowSpec:
    """Parse a spec file's text; InvalidWorkflow when it cannot be served."""
    document = load_yaml(text)
    models = document.get("models") or {}
    if not isinstance(models, Mapping):
        raise InvalidWorkflow("'models' must be a mapping")
    dag = document.get("dag")
    if not isinstance(dag, Mapping) or not dag:
        raise InvalidWorkflow("the workflow spec has no 'dag' (a mapping of node -> the nodes "
                              "it feeds)")
    # NOTE: TorchServe applies a global key only to the models listed after it; here the
    # global keys apply to every node wherever they stand.
    defaults = NodeSettings().with_values(_settings("models", models))
    entries: dict[str, Mapping[str, object]] = {}
    for key, entry in models.items():
        if key in SETTING_KEYS:
            continue
        name = _node_name("models", key)
        if not isinstance(entry, Mapping):
            raise InvalidWorkflow(f"models: {name} must be a mapping (url and settings), "
                                  f"got {entry!r}")
        url = entry.get("url")
        if url is not None and (not isinstance(url, str) or not url.strip()):
            raise InvalidWorkflow(f"models: {name}: url must be a string, got {url!r}")
        entries[name] = entry

    edges: dict[str, tuple[str, ...]] = {}
    order: list[str] = []
    for key, children in dag.items():
        name = _node_name("dag", key)
        if children is None:
            children = []
        if not isinstance(children, list):
            raise InvalidWorkflow(f"dag: {name} must list the nodes it feeds ([a, b]), got "
                                  f"{children!r}")
        # TorchServe skips empty entries ([m1, ] or [""]).
        targets = tuple(_node_name(f"dag: {name}", child) for child in children
                        if child is not None and str(child).strip())
        edges[name] = targets
        for node in (name, *targets):
            if node not in order:
                order.append(node)

    nodes: dict[str, NodeSpec] = {}
    for name in order:
        entry = entries.get(name)
        if entry is None:
            # TorchServe's function node: one worker, one request per call, no batch delay;
            # the global retry-attempts and timeout-ms.
            settings = NodeSettings(1, 1, defaults.batch_size, 0, defaults.retry_attempts,
                                    defaults.timeout_ms)
            nodes[name] = NodeSpec(name, None, settings)
            continue
        overrides = _settings(f"models: {name}", entry)
        url = entry.get("url")
        if url is None:  # batchserve's extension: a function that takes whole batches
            settings = NodeSettings(1, 1, defaults.batch_size, 0, defaults.retry_attempts,
                                    defaults.timeout_ms).with_values(overrides)
            nodes[name] = NodeSpec(name, None, settings, batched=True)
        else:
            assert isinstance(url, str)
            nodes[name] = NodeSpec(name, url.strip(), defaults.with_values(overrides))
        settings = nodes[name].settings
        if settings.max_workers < settings.min_workers:
            raise InvalidWorkflow(f"models: {name}: max-workers ({settings.max_workers}) is "
                                  f"below min-workers ({settings.min_workers})")
    return WorkflowSpec(defaults, nodes, edges)
