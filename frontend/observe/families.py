"""TorchServe's metrics as its frontend keeps them (its ``IMetric``): one object per metric of
the metrics configuration, and per metric a handler reports that the configuration does not
declare when ``model_metrics_auto_detect`` is on.

Each is updated with the values of its dimensions, in their order (the last is the host
name), and a value: a counter adds it (a negative one is refused), a gauge keeps it, a
histogram counts it into simpleclient's default buckets. In ``prometheus`` mode it is kept for
the metrics page (``family``); in ``log`` mode each update is a line of ``ts_metrics.log`` or
``model_metrics.log``; ``legacy`` mode keeps only TorchServe's three ``ts_*`` counters for the
page.

A metric keeps at most ``MAX_LABEL_SETS`` label sets: a handler that puts a request id or a
user's text in a dimension cannot grow the server's memory and the metrics page without
bound; the sets past the cap are dropped, and the first one dropped is logged. Handlers'
metrics also share one ``PageBudget``: the bytes their label sets may take on the page, all
of them together (``model_metrics.py``).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

from frontend.observe.exposition import Family, escape_label, java_double
from frontend.observe.metric_log import MetricLog
from frontend.observe.metric_specs import MetricSpec

logger = logging.getLogger(__name__)

#: A metric's most label sets (children); past it, new ones are dropped.
MAX_LABEL_SETS = 1000
#: simpleclient's default histogram buckets (TorchServe sets none of its own).
HISTOGRAM_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0)
#: The only metrics ``legacy`` mode exposes (TorchServe's MetricBuilder).
LEGACY = ("ts_inference_requests_total", "ts_inference_latency_microseconds",
          "ts_queue_latency_microseconds")


class PageBudget:
    """The bytes the label sets of some metrics (handlers') may take on the metrics page, all
    together: a new label set that would pass it is dropped (the first one logged)."""

    __slots__ = ("_logged", "left_bytes")

    def __init__(self, limit_bytes: int) -> None:
        self.left_bytes = limit_bytes
        self._logged = False

    def spend(self, metric: str, cost_bytes: int) -> bool:
        """Take ``cost_bytes`` for a new label set of ``metric``; False: there is not that
        much left, and it must be dropped."""
        if cost_bytes <= self.left_bytes:
            self.left_bytes -= cost_bytes
            return True
        if not self._logged:
            self._logged = True
            logger.warning("handlers' metrics take all the metrics page may give them: a new "
                           "label set of %s and any later new label set of a handler's metric "
                           "are dropped", metric)
        return False


class TsMetric:
    """One metric: its declaration and how an update is kept."""

    __slots__ = ("_warned", "spec")

    def __init__(self, spec: MetricSpec) -> None:
        self.spec = spec
        self._warned = False

    def add(self, values: tuple[str, ...], value: float, request_ids: str | None = None) -> None:
        """One update: a value per dimension, and the value. ``request_ids`` is given for a
        handler's metric (the log line names the requests)."""
        raise NotImplementedError

    def family(self) -> Family | None:
        """What the metrics page shows of it (None: it is not on the page)."""
        return None

    def _refuse(self, why: str) -> None:
        """An update that cannot be kept: logged the first time (TorchServe logs each)."""
        if not self._warned:
            self._warned = True
            logger.error("Failed to update metric %s: %s (later failures of this metric are "
                         "not logged)", self.spec.name, why)


class _Prometheus(TsMetric):
    __slots__ = ("_full", "_help", "budget", "children")

    def __init__(self, spec: MetricSpec) -> None:
        super().__init__(spec)
        self._help = f"Torchserve prometheus {spec.type} metric with unit: {spec.unit}"
        self._full = False
        self.children: dict[tuple[str, ...], list[float]] = {}
        #: What its label sets take from (None: the server's own metric, not bounded so).
        self.budget: PageBudget | None = None

    def _child(self, values: tuple[str, ...]) -> list[float] | None:
        """The state of a new label set, or None when it cannot be kept (wrong number of
        values, or the metric has all the label sets it may)."""
        if len(values) != len(self.spec.dimensions):
            self._refuse(f"{len(values)} dimension values for the dimensions "
                         f"{list(self.spec.dimensions)}")
            return None
        if len(self.children) >= MAX_LABEL_SETS:
            if not self._full:
                self._full = True
                logger.warning("metric %s has %d label sets, the most it may have: new ones are "
                               "dropped (is a dimension's value unbounded, such as a request "
                               "id?)", self.spec.name, MAX_LABEL_SETS)
            return None
        if self.budget is not None and not self.budget.spend(self.spec.name,
                                                             self._page_bytes(values)):
            return None
        child = self.children[values] = self._new_state()
        return child

    def _new_state(self) -> list[float]:
        return [0.0]

    #: The lines a label set takes on the page.
    _LINES = 1

    def _page_bytes(self, values: tuple[str, ...]) -> int:
        """About what a label set takes on the page: its lines, each its name, its labels
        as written, and a value (a histogram's bucket lines have an ``le`` more)."""
        labels = sum(len(label) + len(escape_label(value).encode()) + 4
                     for label, value in zip(self.spec.dimensions, values, strict=True))
        return self._LINES * (len(self.spec.name) + labels + 40)

    def family(self) -> Family:
        family = Family(self.spec.name, self._help, self.spec.type)
        labels = self.spec.dimensions
        for values, state in list(self.children.items()):
            family.add(labels, values, state[0])
        return family


class PrometheusCounter(_Prometheus):
    __slots__ = ()

    def add(self, values: tuple[str, ...], value: float, request_ids: str | None = None) -> None:
        if value < 0:
            self._refuse(f"a counter cannot be increased by {value}")
            return
        state = self.children.get(values) or self._child(values)
        if state is not None:
            state[0] += value


class PrometheusGauge(_Prometheus):
    __slots__ = ()

    def add(self, values: tuple[str, ...], value: float, request_ids: str | None = None) -> None:
        state = self.children.get(values) or self._child(values)
        if state is not None:
            state[0] = value


class PrometheusHistogram(_Prometheus):
    """Counts per bucket (the last: above every bound), then the count and the sum."""

    __slots__ = ()
    _LINES = len(HISTOGRAM_BUCKETS) + 3

    def _new_state(self) -> list[float]:
        return [0.0] * (len(HISTOGRAM_BUCKETS) + 3)

    def add(self, values: tuple[str, ...], value: float, request_ids: str | None = None) -> None:
        state = self.children.get(values) or self._child(values)
        if state is not None:
            state[bisect.bisect_left(HISTOGRAM_BUCKETS, value)] += 1
            state[-2] += 1
            state[-1] += value

    def family(self) -> Family:
        family = Family(self.spec.name, self._help, "histogram")
        labels = self.spec.dimensions
        bucket_labels = (*labels, "le")
        bounds = [*map(java_double, HISTOGRAM_BUCKETS), "+Inf"]
        for values, state in list(self.children.items()):
            seen = 0.0
            for bound, count in zip(bounds, state[:-2], strict=True):
                seen += count
                family.add(bucket_labels, (*values, bound), seen, "_bucket")
            family.add(labels, values, state[-2], "_count")
            family.add(labels, values, state[-1], "_sum")
        return family


#: The separators of a metric log line, escaped in a dimension's value: a value a handler
#: reports (a client's text, say) cannot add a dimension or a host name to the line.
#: (TorchServe's frontend never writes them: its worker line reader splits values on them.)
_LOG_SEPARATORS = str.maketrans({",": "\\x2c", "|": "\\x7c", ":": "\\x3a"})


class LogMetric(TsMetric):
    """A metric written to a metric log, a line per update."""

    __slots__ = ("_frontend", "_model", "_prefix")

    def __init__(self, spec: MetricSpec, frontend: MetricLog, model: MetricLog) -> None:
        super().__init__(spec)
        self._frontend = frontend
        self._model = model
        self._prefix = f"{spec.name}.{spec.unit}:"

    def add(self, values: tuple[str, ...], value: float, request_ids: str | None = None) -> None:
        names = self.spec.dimensions
        count = min(len(names), len(values)) - 1
        dims = ",".join(f"{names[i]}:{values[i].translate(_LOG_SEPARATORS)}"
                        for i in range(count))
        host = values[-1] if values else ""
        line = f"{self._prefix}{java_double(value)}|#{dims}|#hostname:{host}"
        stamp = f"timestamp:{int(time.time())}"
        if request_ids is None:
            self._frontend.write(f"{line},{stamp}")
        else:
            # A value reported for no request: Java writes the missing id as "null".
            self._model.write(f"{line},requestID:{request_ids or 'null'},{stamp}")


def counter_total(metric: TsMetric | None, values: tuple[str, ...]) -> list[float] | None:
    """The running total of one label set of a Prometheus counter, for a hot path to add to
    without a call (``total[0] += value``; the value must not be negative). None when
    ``metric`` is not such a counter, or cannot keep that label set: update it with ``add``.
    Asking creates the label set's sample."""
    if type(metric) is not PrometheusCounter:
        return None
    return metric.children.get(values) or metric._child(values)


def gauge_value(metric: TsMetric | None, values: tuple[str, ...]) -> list[float] | None:
    """The value of one label set of a Prometheus gauge that has it, for a hot path to set
    without a call (``value[0] = new``); None otherwise."""
    if type(metric) is not PrometheusGauge:
        return None
    return metric.children.get(values)


def build(spec: MetricSpec, mode: str, logs: Sequence[MetricLog],
          budget: PageBudget | None = None) -> TsMetric:
    """The metric ``spec`` declares, kept as ``mode`` keeps it (``logs``: the frontend's and
    the model metrics' log; ``budget``: what its label sets take from on the page)."""
    if mode == "prometheus" or (mode == "legacy" and spec.name in LEGACY):
        if mode == "legacy":  # TorchServe makes the legacy three counters whatever declared
            spec = MetricSpec(spec.name, spec.unit, "counter", spec.dimensions)
        kinds: dict[str, type[_Prometheus]] = {
            "counter": PrometheusCounter, "gauge": PrometheusGauge,
            "histogram": PrometheusHistogram}
        metric = kinds[spec.type](spec)
        metric.budget = budget
        return metric
    return LogMetric(spec, logs[0], logs[1])
