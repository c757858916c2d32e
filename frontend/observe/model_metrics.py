"""What handlers report through ``context.metrics`` (TorchServe's ``model_metrics``), kept so
that no handler, and no client whose text a handler reports, can break the metrics page, pass
for another metric, or grow the page without bound.

Values come only in the worker's frames (the ``metrics`` of a batch's ``PredictResult`` and of
``Loaded``), never from the text a worker prints: a handler that prints what a client sent
would let the client write a metric line (``frontend/serving/launcher.py``, which tells a
worker that prints TorchServe's ``METRICS_MARK`` so, once).

A metric is kept only under TorchServe's rules for its name, unit and dimensions
(``metric_specs.handler_problem``), and only under a name that no other metric takes on the
page, as Prometheus' parsers read it (``metric_specs.NameClaims``): not the server's own,
TorchServe's frontend metrics (declared or not) and every ``batchserve_*``, in every
``metrics_mode``; nor a handler metric's kept before it. A metric of the configuration that
breaks them stops the start, naming it; a handler's is dropped, and logged once per name.

Bounds, each logged the first time it drops something:

* ``MAX_AUTO_DETECTED`` metrics that handlers add to the configuration's;
* ``families.MAX_LABEL_SETS`` label sets per metric;
* ``MAX_LABEL_VALUE_CHARS`` characters per label value (a longer one is cut to it);
* ``MAX_PAGE_BYTES`` bytes of the metrics page for the label sets of every handler metric
  together.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence

from frontend.errors import ConfigError
from frontend.observe.exposition import Family
from frontend.observe.families import PageBudget, TsMetric, build
from frontend.observe.metric_log import MetricLog
from frontend.observe.metric_specs import (
    HOSTNAME_DIMENSION,
    MAX_NAME_CHARS,
    METRIC_TYPES,
    MetricsConfig,
    MetricSpec,
    NameClaims,
    handler_problem,
    shown,
)
from protos import worker_pb2

logger = logging.getLogger(__name__)

#: What begins a metric line in a TorchServe worker's output. No line is read as a metric here
#: (see the module docstring); a worker that prints one is told so once.
METRICS_MARK = "[METRICS]"
#: Metrics handlers may add to the configuration's (``model_metrics_auto_detect``).
MAX_AUTO_DETECTED = 100
#: Refused metrics remembered (and logged); past them, a refusal is neither.
MAX_REFUSED = 1000
#: A longer label value is cut to this many characters.
MAX_LABEL_VALUE_CHARS = 256
#: What the label sets of all handler metrics may take on the metrics page.
MAX_PAGE_BYTES = 4 * 1024 * 1024


class ModelMetrics:
    """The handler metrics of one server: those its configuration declares, then those handlers
    report (with ``auto_detect``)."""

    def __init__(self, config: MetricsConfig, mode: str, logs: Sequence[MetricLog],
                 claims: NameClaims, hostname: str, *, auto_detect: bool = False,
                 page_bytes: int = MAX_PAGE_BYTES) -> None:
        """``claims``: the names the server's own metrics took; ``hostname``: every value's
        last label (TorchServe's frontend adds its own host name)."""
        self._mode = mode
        self._logs = logs
        self._claims = claims
        self._hostname = hostname
        self._auto_detect = auto_detect
        self._config_path = config.path
        self.budget = PageBudget(page_bytes)
        self.metrics: dict[str, TsMetric] = {}
        for spec in config.model_metrics.values():
            problem = self._problem(spec)
            if problem is not None:
                raise ConfigError(f"metrics_config {config.path}: model_metrics: {problem}")
            self._keep(spec)
        self._most = len(self.metrics) + MAX_AUTO_DETECTED
        #: Hashes of the (name, type, unit, dimensions) of reported metrics that are not kept:
        #: the same report again is dropped at once (another of the name is looked at anew).
        self._refused: set[int] = set()
        #: Names whose refusal was logged (their first MAX_NAME_CHARS + 1 characters).
        self._told: set[str] = set()
        #: Metrics that had a label value cut (logged once each).
        self._cut: set[str] = set()

    def _problem(self, spec: MetricSpec) -> str | None:
        return handler_problem(spec) or self._claims.conflict(spec.name, spec.type)

    def _keep(self, spec: MetricSpec) -> TsMetric:
        metric = self.metrics[spec.name] = build(spec, self._mode, self._logs, self.budget)
        self._claims.take(spec.name, (spec.type,))
        return metric

    def record(self, reported: Iterable[worker_pb2.Metric]) -> None:
        """Values handlers reported: each goes to its metric, with the host name as its last
        label; an undeclared one only with ``auto_detect``."""
        for value in reported:
            metric = self.metrics.get(value.name)
            if metric is None:
                metric = self._detected(value)
                if metric is None:
                    continue
            labels = (*value.dimension_values, self._hostname)
            if any(len(label) > MAX_LABEL_VALUE_CHARS for label in labels):
                labels = self._cut_values(value.name, labels)
            metric.add(labels, value.value, value.request_id)

    def _cut_values(self, name: str, labels: tuple[str, ...]) -> tuple[str, ...]:
        if name not in self._cut:
            self._cut.add(name)
            logger.warning("handler metric %s: a label value longer than %d characters is cut "
                           "to that length (later ones are not logged)", name,
                           MAX_LABEL_VALUE_CHARS)
        return tuple(label[:MAX_LABEL_VALUE_CHARS] for label in labels)

    def _detected(self, value: worker_pb2.Metric) -> TsMetric | None:
        """A metric for a value of an undeclared metric, or None (logged once per name)."""
        name = value.name
        key = hash((name, value.type, value.unit, *value.dimension_names))
        if key in self._refused:
            return None
        spec = MetricSpec(name, value.unit, value.type,
                          (*value.dimension_names, HOSTNAME_DIMENSION))
        why = None
        if not self._auto_detect:
            why = (f"it is not in the metrics configuration ({self._config_path}) and "
                   "model_metrics_auto_detect is off")
        elif len(self.metrics) >= self._most:
            why = f"handlers added {MAX_AUTO_DETECTED} metrics already"
        elif value.type not in METRIC_TYPES:
            why = f"its type {shown(value.type)} is none of {', '.join(METRIC_TYPES)}"
        else:
            why = self._problem(spec)
        if why is not None:
            if len(self._refused) < MAX_REFUSED:
                self._refused.add(key)
            told = name[:MAX_NAME_CHARS + 1]
            if told not in self._told and len(self._told) < MAX_REFUSED:
                self._told.add(told)
                logger.warning("handler metric %s is dropped: %s", shown(name), why)
            return None
        logger.info("Registering auto detected backend metric: %s (%s, unit %s, dimensions %s)",
                    name, spec.type, spec.unit, list(spec.dimensions))
        return self._keep(spec)

    def families(self) -> Iterator[Family]:
        """Their families on the metrics page (none in ``log`` mode)."""
        for metric in list(self.metrics.values()):
            family = metric.family()
            if family is not None:
                yield family
