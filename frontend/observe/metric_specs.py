r"""TorchServe's metrics configuration (``metrics_config``, a ``metrics.yaml``): which metrics
exist, their types, units and dimensions.

``ts_metrics`` are the frontend's (requests, the queue, workers, the host): a metric TorchServe's
frontend emits is emitted only when the configuration declares it. ``model_metrics`` are what
handlers report through ``context.metrics``; ``Hostname`` is added to their dimensions, as
TorchServe's frontend adds it. The default is TorchServe's own file, shipped beside this
module. The file is read with TorchServe's rules: the sections ``counter``, ``gauge`` and
``histogram``, each a list of ``name``, ``unit`` and ``dimensions``; a later declaration of a
name replaces an earlier one.

What a handler's metric may be called (``handler_problem``) is TorchServe's rule, in every
``metrics_mode``: a metric reaches TorchServe's frontend as a ``name.unit:value|#dims`` line
that it reads with ``[\w\s]+`` for the name and the unit, and its Prometheus client takes only
Prometheus names (no ``le`` label on a histogram, no ``__`` label). So a handler's metric name
is ``[a-zA-Z_][a-zA-Z0-9_]*``, its unit ``[A-Za-z0-9_ ]*``, each dimension a Prometheus label
name other than ``Hostname`` (the server adds it), none twice; with at most
``MAX_NAME_CHARS`` characters per name, ``MAX_UNIT_CHARS`` for the unit and
``MAX_DIMENSIONS`` dimensions. ``NameClaims`` keeps two metrics from ever taking the same
name on the metrics page, as Prometheus' parsers read it.
"""

from __future__ import annotations

import functools
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
#: Checked with ``fullmatch`` (``match`` with ``$`` lets a trailing newline through).
_PROMETHEUS_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_PROMETHEUS_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
#: A handler's metric: a Prometheus name that TorchServe's worker line can carry (no ``:``).
_HANDLER_NAME = _PROMETHEUS_LABEL
_HANDLER_UNIT = re.compile(r"[A-Za-z0-9_ ]*")
MAX_NAME_CHARS = 128
MAX_UNIT_CHARS = 64
#: A handler metric's own dimensions (``Hostname`` is added to them).
MAX_DIMENSIONS = 16
#: The server's own families (``batchserve_*``): no metric of a configuration or a handler
#: may take a name that begins so.
SERVER_PREFIX = "batchserve_"
#: The names a family of each type takes on the page beside its own (simpleclient's
#: registry refuses a second family that takes one of them; Prometheus' parsers read a
#: counter ``x`` as ``x_total`` and a counter ``x_total`` as the family ``x``).
_SUFFIXES = {"counter": ("_total", "_created"), "gauge": (),
             "histogram": ("_bucket", "_count", "_sum", "_created")}


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


@functools.cache
def torchserve_ts_metrics() -> tuple[str, ...]:
    """The names of TorchServe's own frontend metrics (its default ``ts_metrics``): the
    server's, whatever the configuration declares."""
    return tuple(load_metrics_config().ts_metrics)


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


def shown(text: str) -> str:
    """``text`` for a message: quoted, escaped, at most about 60 characters of it."""
    return repr(text if len(text) <= 60 else text[:60] + "...")


def prometheus_problem(spec: MetricSpec) -> str | None:
    """Why ``spec`` cannot be a Prometheus family (its name or a label name), or None."""
    if not _PROMETHEUS_NAME.fullmatch(spec.name):
        return f"{shown(spec.name)} is not a Prometheus metric name"
    return _labels_problem(spec)


def _labels_problem(spec: MetricSpec) -> str | None:
    for label in spec.dimensions:
        if not _PROMETHEUS_LABEL.fullmatch(label) or label.startswith("__") or \
                (spec.type == "histogram" and label == "le"):
            return f"{spec.name}: {shown(label)} is not a Prometheus label name"
    if len(set(spec.dimensions)) != len(spec.dimensions):
        twice = next(label for label in spec.dimensions if spec.dimensions.count(label) > 1)
        return f"{spec.name}: the label {shown(twice)} is named twice"
    return None


def handler_problem(spec: MetricSpec) -> str | None:
    """Why a handler's metric ``spec`` (its dimensions ending with ``Hostname``) cannot be
    kept, in any metrics_mode, or None (the module's docstring has the rule)."""
    name = spec.name
    if len(name) > MAX_NAME_CHARS:
        return f"its name is longer than {MAX_NAME_CHARS} characters"
    if not _HANDLER_NAME.fullmatch(name):
        return (f"{shown(name)} is not a metric name TorchServe takes "
                "(letters, digits and '_', not first a digit)")
    if name.startswith(SERVER_PREFIX):
        return f"names beginning with {SERVER_PREFIX} are the server's own metrics"
    if len(spec.unit) > MAX_UNIT_CHARS or not _HANDLER_UNIT.fullmatch(spec.unit):
        return (f"{name}: its unit {shown(spec.unit)} is not one TorchServe takes (letters, "
                f"digits, '_' and spaces, at most {MAX_UNIT_CHARS})")
    own = spec.dimensions[:-1]
    if len(own) > MAX_DIMENSIONS:
        return f"{name}: {len(own)} dimensions, more than {MAX_DIMENSIONS}"
    if HOSTNAME_DIMENSION in own:
        return f"{name}: the dimension {HOSTNAME_DIMENSION} is the server's (it adds it)"
    if any(len(label) > MAX_NAME_CHARS for label in own):
        return f"{name}: a dimension's name is longer than {MAX_NAME_CHARS} characters"
    return _labels_problem(spec)


def claims(name: str, kind: str) -> tuple[str, ...]:
    """The names a family ``name`` of type ``kind`` takes on the page: its own, its samples',
    and what Prometheus' parsers read them as."""
    base = name.removesuffix("_total") if kind == "counter" else name
    return (name, base, *(base + suffix for suffix in _SUFFIXES[kind]))


class NameClaims:
    """Which metric took each name of the page (``claims``): a metric that would take one
    already taken is refused, so no family is written twice or read as another."""

    def __init__(self) -> None:
        self._owners: dict[str, str] = {}

    def conflict(self, name: str, kind: str) -> str | None:
        """Why a metric ``name`` of type ``kind`` cannot be added, or None."""
        for claim in claims(name, kind):
            owner = self._owners.get(claim)
            if owner is not None:
                return (f"{name} is the name of the metric {owner}" if owner == name else
                        f"{name} collides with the metric {owner} (both would be read as "
                        f"{claim})")
        return None

    def take(self, name: str, kinds: tuple[str, ...]) -> None:
        """Claim the names of a metric ``name`` of each type in ``kinds`` (the server's own
        take every type's: no handler metric may be read as one of them)."""
        for kind in kinds:
            for claim in claims(name, kind):
                self._owners.setdefault(claim, name)
