"""TorchServe's metrics configuration (``metrics_config``, a ``metrics.yaml``): which metrics
exist, their types, units and dimensions.

``ts_metrics`` are the frontend's (requests, the queue, workers, the host): a metric TorchServe's
frontend emits is emitted only when the configuration declares it. ``model_metrics`` are what
handlers report through ``context.metrics``; ``Hostname`` is added to their dimensions, as
TorchServe's frontend adds it. The default is TorchServe's own file, shipped beside this
module. The file is read with TorchServe's rules: the sections ``counter``, ``gauge`` and
``histogram``, each a list of ``name``, ``unit`` and ``dimensions``; a later declaration of a
name replaces an earlier one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from frontend.errors import ConfigError

#: TorchServe's own metrics.yaml (ts/configs/metrics.yaml of TorchServe 0.12).
DEFAULT_METRICS_CONFIG = Path(__file__).resolve().with_name("metrics.yaml")
METRIC_TYPES = ("counter", "gauge", "histogram")
#: TorchServe's frontend adds it to every model metric's dimensions (their last label).
HOSTNAME_DIMENSION = "Hostname"
_SECTIONS = ("ts_metrics", "model_metrics")
_PROMETHEUS_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_PROMETHEUS_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One declared metric."""

    name: str
    unit: str
    type: str  # "counter", "gauge" or "histogram"
    dimensions: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """A metrics configuration: its file, and its metrics by name, in the file's order."""

    path: Path
    ts_metrics: Mapping[str, MetricSpec]
    model_metrics: Mapping[str, MetricSpec]


def load_metrics_config(path: Path | None = None) -> MetricsConfig:
    """Read a metrics configuration (TorchServe's default without ``path``); ConfigError
    says what is wrong and where."""
    path = (path or DEFAULT_METRICS_CONFIG).resolve()
    import yaml  # pyyaml, a dependency; only the start pays for it

    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"metrics_config {path}: cannot read it: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"metrics_config {path}: not YAML: {exc}") from exc
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise ConfigError(f"metrics_config {path}: expected a mapping with ts_metrics and "
                          f"model_metrics, got {type(document).__name__}")
    unknown = set(document) - {"dimensions", *_SECTIONS}
    if unknown:
        raise ConfigError(f"metrics_config {path}: unknown key(s) {', '.join(sorted(unknown))} "
                          "(expected dimensions, ts_metrics, model_metrics)")
    sections = {key: _section(path, key, document.get(key)) for key in _SECTIONS}
    model = {name: MetricSpec(spec.name, spec.unit, spec.type,
                              (*spec.dimensions, HOSTNAME_DIMENSION))
             for name, spec in sections["model_metrics"].items()}
    return MetricsConfig(path, sections["ts_metrics"], model)


def _section(path: Path, key: str, section: Any) -> dict[str, MetricSpec]:
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(f"metrics_config {path}: {key} must map counter, gauge and histogram "
                          f"to lists of metrics, got {type(section).__name__}")
    specs: dict[str, MetricSpec] = {}
    for kind, entries in section.items():
        if kind not in METRIC_TYPES:
            raise ConfigError(f"metrics_config {path}: {key}.{kind}: unknown metric type "
                              f"(expected {', '.join(METRIC_TYPES)})")
        if entries is None:
            continue
        if not isinstance(entries, list):
            raise ConfigError(f"metrics_config {path}: {key}.{kind} must be a list of metrics")
        for index, entry in enumerate(entries):
            spec = _spec(f"metrics_config {path}: {key}.{kind}[{index}]", kind, entry)
            specs.pop(spec.name, None)  # a later declaration replaces it, in its own place
            specs[spec.name] = spec
    return specs


def _spec(where: str, kind: str, entry: Any) -> MetricSpec:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping with name, unit and dimensions")
    unknown = set(entry) - {"name", "unit", "dimensions"}
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(map(str, unknown)))}")
    name, unit, dimensions = entry.get("name"), entry.get("unit"), entry.get("dimensions")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: a metric needs a name")
    if unit is None or unit == "":
        raise ConfigError(f"{where} ({name}): a metric needs a unit")
    if dimensions is None:
        raise ConfigError(f"{where} ({name}): a metric needs its dimensions (a list, maybe [])")
    if not isinstance(dimensions, list) or not all(isinstance(d, str) and d
                                                   for d in dimensions):
        raise ConfigError(f"{where} ({name}): dimensions must be a list of names")
    if len(set(dimensions)) != len(dimensions):
        raise ConfigError(f"{where} ({name}): a dimension is named twice")
    return MetricSpec(name, str(unit), kind, tuple(dimensions))


def prometheus_problem(spec: MetricSpec) -> str | None:
    """Why ``spec`` cannot be a Prometheus family (its name or a label name), or None."""
    if not _PROMETHEUS_NAME.match(spec.name):
        return f"{spec.name!r} is not a Prometheus metric name"
    for label in spec.dimensions:
        if not _PROMETHEUS_LABEL.match(label) or label.startswith("__") or \
                (spec.type == "histogram" and label == "le"):
            return f"{spec.name}: {label!r} is not a Prometheus label name"
    return None
