"""Writes deploy/grafana/batchserve.json, the Grafana dashboard for batchserve's metrics.

The dashboard is built here, not edited by hand: every panel gets a unique id and a place on
the grid, and every query gets the same filters. Run ``python deploy/grafana/generate.py``
after a change; ``tests/unit/test_grafana_dashboard.py`` fails while the committed JSON
differs from what this writes, validates it against Grafana's JSON schemas
(``deploy/grafana/schema``) and checks every query with Prometheus' own promtool against the
metrics a real server exports.

Queries name TorchServe's metric families as TorchServe writes them (``ts_*``,
``Requests2XX``, ``QueueTime``, the host's ``CPUUtilization`` ...; a TorchServe dashboard's
queries work unchanged) and batchserve's own (``batchserve_*``), filtered by the variables
``$job``, ``$instance`` and ``$model`` (the ``model_name`` label). The data source is the
variable ``$datasource``, so the file imports into any Grafana (10 or later) as it is, through
the UI or a provisioning directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).resolve().with_name("batchserve.json")
UID = "batchserve-overview"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
#: The interval of rate() and increase() in panels: Grafana's, at least 4 scrape intervals.
RATE = "$__rate_interval"
HOST = 'job=~"$job",instance=~"$instance"'
#: Handlers' metrics name their model in TorchServe's dimension ModelName.
HANDLER_MODEL = 'ModelName=~"$model"'
#: The label naming the model: ``model_name`` on every family (TorchServe's ts_* and
#: batchserve's); kept as a table so a family that names it otherwise can say so.
MODEL_LABEL: dict[str, str] = {}

Json = dict[str, Any]


def model_label(metric: str) -> str:
    """The label that names the model in ``metric`` (a family, or a histogram's sample)."""
    family = metric.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
    return MODEL_LABEL.get(family, "model_name")


def _m(metric: str, extra: str = "") -> str:
    """``metric`` with the model filters (and ``extra`` matchers)."""
    return f'{metric}{{{HOST},{model_label(metric)}=~"$model"{"," + extra if extra else ""}}}'


def _h(metric: str, extra: str = "") -> str:
    """``metric`` with the host filters only (TorchServe's host and status metrics)."""
    return f"{metric}{{{HOST}{',' + extra if extra else ''}}}"


def _rate(selector: str, by: str = "model_name") -> str:
    return f"sum by ({by}) (rate({selector}[{RATE}]))"


def _quantile(q: float, histogram: str, by: str | None = None) -> str:
    """The ``q`` quantile of ``histogram`` per model (or per ``by``)."""
    return (f"histogram_quantile({q}, sum by ({by or model_label(histogram)}, le) "
            f"(rate({_m(histogram + '_bucket')}[{RATE}])))")


def _mean(histogram: str, by: str | None = None) -> str:
    """The mean of ``histogram`` per model (or per ``by``): the rate of its sum over its
    count's."""
    by = by or model_label(histogram)
    return (f"{_rate(_m(histogram + '_sum'), by)}\n  /\n"
            f"{_rate(_m(histogram + '_count'), by)}")


def _target(expr: str, legend: str, ref: str, *, fmt: str = "time_series",
            instant: bool = False) -> Json:
    target: Json = {"datasource": DATASOURCE, "editorMode": "code", "expr": expr,
                    "legendFormat": legend, "range": not instant, "instant": instant,
                    "format": fmt, "refId": ref}
    return target


def _targets(*queries: tuple[str, str]) -> list[Json]:
    return [_target(expr, legend, chr(ord("A") + index))
            for index, (expr, legend) in enumerate(queries)]


def _field_defaults(unit: str, *, minimum: float | None = 0, custom: Json | None = None,
                    thresholds: list[tuple[float | None, str]] | None = None) -> Json:
    defaults: Json = {"unit": unit, "color": {"mode": "palette-classic"}}
    if minimum is not None:
        defaults["min"] = minimum
    if thresholds is not None:
        defaults["color"] = {"mode": "thresholds"}
        defaults["thresholds"] = {"mode": "absolute", "steps": [
            {"value": value, "color": color} for value, color in thresholds]}
    if custom is not None:
        defaults["custom"] = custom
    return defaults


def timeseries(title: str, description: str, unit: str, *queries: tuple[str, str],
               stack: bool = False, bars: bool = False) -> Json:
    """A time series panel: one line (or stacked area, or bars) per series."""
    custom: Json = {"drawStyle": "bars" if bars else "line", "lineWidth": 1,
                    "fillOpacity": 30 if stack or bars else 10, "showPoints": "never",
                    "spanNulls": False,
                    "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
    return {"type": "timeseries", "title": title, "description": description,
            "datasource": DATASOURCE, "targets": _targets(*queries),
            "fieldConfig": {"defaults": _field_defaults(unit, custom=custom), "overrides": []},
            "options": {"legend": {"displayMode": "table", "placement": "bottom",
                                   "showLegend": True, "calcs": ["mean", "max", "lastNotNull"]},
                        "tooltip": {"mode": "multi", "sort": "desc"}}}


def stat(title: str, description: str, unit: str, expr: str,
         thresholds: list[tuple[float | None, str]]) -> Json:
    """A single number (the last value), coloured by ``thresholds``."""
    return {"type": "stat", "title": title, "description": description,
            "datasource": DATASOURCE, "targets": [_target(expr, title, "A")],
            "fieldConfig": {"defaults": _field_defaults(unit, thresholds=thresholds),
                            "overrides": []},
            "options": {"graphMode": "area", "colorMode": "value", "justifyMode": "auto",
                        "textMode": "auto", "wideLayout": True, "showPercentChange": False,
                        "reduceOptions": {"calcs": ["lastNotNull"], "values": False,
                                          "fields": ""},
                        "percentChangeColorMode": "standard", "orientation": "auto"}}


def heatmap(title: str, description: str, unit: str, expr: str) -> Json:
    """A heatmap of a histogram's buckets (``expr`` sums the increase of ``_bucket`` by le)."""
    target = _target(expr, "{{le}}", "A", fmt="heatmap")
    return {"type": "heatmap", "title": title, "description": description,
            "datasource": DATASOURCE, "targets": [target], "maxDataPoints": 60,
            "fieldConfig": {"defaults": {"custom": {"scaleDistribution": {"type": "linear"},
                                                    "hideFrom": {"legend": False,
                                                                 "tooltip": False,
                                                                 "viz": False}}},
                            "overrides": []},
            "options": {"calculate": False, "cellGap": 1,
                        "color": {"mode": "scheme", "scheme": "Oranges", "fill": "dark-orange",
                                  "scale": "exponential", "exponent": 0.5, "steps": 64,
                                  "reverse": False},
                        "showValue": "auto", "yAxis": {"unit": unit, "axisPlacement": "left"},
                        "rowsFrame": {"layout": "auto"},
                        "legend": {"show": True}, "tooltip": {"mode": "single",
                                                              "yHistogram": True},
                        "exemplars": {"color": "rgba(255,0,255,0.7)"},
                        "filterValues": {"le": 1e-09}}}


def bargauge(title: str, description: str, unit: str, *queries: tuple[str, str]) -> Json:
    """Horizontal bars, one per series (the last value)."""
    return {"type": "bargauge", "title": title, "description": description,
            "datasource": DATASOURCE, "targets": _targets(*queries),
            "fieldConfig": {"defaults": _field_defaults(unit, thresholds=[(None, "green")]),
                            "overrides": []},
            "options": {"displayMode": "gradient", "valueMode": "color",
                        "namePlacement": "auto", "showUnfilled": True, "sizing": "auto",
                        "minVizWidth": 8, "minVizHeight": 16, "maxVizHeight": 300,
                        "legend": {"displayMode": "list", "placement": "bottom",
                                   "showLegend": False, "calcs": []},
                        "reduceOptions": {"calcs": ["lastNotNull"], "values": False,
                                          "fields": ""},
                        "orientation": "horizontal"}}


def _responses() -> str:
    """Every response TorchServe's Requests2XX/4XX/5XX counted. Each class is labelled apart
    before the sum: rate() drops the metric name, and a class not counted yet has no series
    (so no ``+``)."""
    classes = [f'label_replace(rate({_h(f"Requests{c}XX")}[{RATE}]), "status", "{c}xx", "", "")'
               for c in "245"]
    return "sum (\n    " + "\n  or\n    ".join(classes) + ")"


#: 5xx over every response; 0 (not "no data") while no 5xx has been counted.
FIVE_XX_SHARE = (f"(sum(rate({_h('Requests5XX')}[{RATE}]))\n  or\n0 * {_responses()})\n"
                 f"  /\n{_responses()}")


# -- the panels, row by row ------------------------------------------------------------------

GREEN = "green"


def overview() -> list[Json]:
    return [
        stat("Requests/s", "Predictions per second, all selected models "
             "(TorchServe's ts_inference_requests_total).", "reqps",
             f"sum(rate({_m('ts_inference_requests_total')}[{RATE}]))", [(None, GREEN)]),
        stat("5xx share", "Share of every HTTP response (and gRPC prediction answer) that was "
             "a 5xx, server-wide (TorchServe's Requests2XX/4XX/5XX).", "percentunit",
             FIVE_XX_SHARE, [(None, GREEN), (0.01, "orange"), (0.05, "red")]),
        stat("p99 latency", "99th percentile of the end-to-end latency in the server, all "
             "selected models (batchserve_request_latency_seconds).", "s",
             f"histogram_quantile(0.99, sum by (le) "
             f"(rate({_m('batchserve_request_latency_seconds_bucket')}[{RATE}])))",
             [(None, GREEN), (0.5, "orange"), (1, "red")]),
        stat("Queued", "Requests waiting in the selected models' queues now.", "short",
             f"sum({_m('batchserve_queue_depth')})", [(None, GREEN), (50, "orange"),
                                                      (90, "red")]),
        stat("Workers", "Worker processes of the selected models now.", "short",
             f"sum({_m('batchserve_workers')})", [(None, "red"), (1, GREEN)]),
        stat("Worker restarts", "Worker restarts (crashes, hangs, failed loads) in the "
             "dashboard's time range.", "short",
             f"sum(increase({_m('batchserve_worker_restarts_total')}[$__range]))",
             [(None, GREEN), (1, "orange"), (5, "red")]),
    ]


def traffic() -> list[Json]:
    return [
        timeseries("Requests/s per model", "Predictions per second per model (TorchServe's "
                   "ts_inference_requests_total: each request that named a known model).",
                   "reqps", (_rate(_m("ts_inference_requests_total")), "{{model_name}}")),
        timeseries("Responses by status", "Every HTTP response on every port and every gRPC "
                   "prediction answer, by status class (TorchServe's Requests2XX/4XX/5XX; "
                   "no model label).", "reqps",
                   (f"sum(rate({_h('Requests2XX')}[{RATE}]))", "2xx"),
                   (f"sum(rate({_h('Requests4XX')}[{RATE}]))", "4xx"),
                   (f"sum(rate({_h('Requests5XX')}[{RATE}]))", "5xx"), stack=True),
        timeseries("Refused per model", "Requests answered without running: the queue was "
                   "full (503), no worker could take them (503), or their deadline passed "
                   "while queued (504).", "reqps",
                   (_rate(_m("batchserve_refused_requests_total"), "model_name, reason"),
                    "{{model_name}} {{reason}}"), stack=True),
        timeseries("Error ratio", "Refused requests over all requests, per model; and the "
                   "5xx share of every response, server-wide.", "percentunit",
                   (f"({_rate(_m('batchserve_refused_requests_total'))}\n  or\n"
                    f"0 * {_rate(_m('batchserve_request_latency_seconds_count'))})\n  /\n"
                    f"{_rate(_m('batchserve_request_latency_seconds_count'))}",
                    "{{model_name}} refused"),
                   (FIVE_XX_SHARE, "5xx (server)")),
    ]


def latency() -> list[Json]:
    latency_s = "batchserve_request_latency_seconds"
    return [
        timeseries("Latency percentiles", "End-to-end latency in the server per model: p50, "
                   "p90, p99 (batchserve_request_latency_seconds).", "s",
                   (_quantile(0.5, latency_s), "{{model_name}} p50"),
                   (_quantile(0.9, latency_s), "{{model_name}} p90"),
                   (_quantile(0.99, latency_s), "{{model_name}} p99")),
        timeseries("Queue wait percentiles", "Time a request waited in its model's queue "
                   "before its batch left: p50, p99 (batchserve_queue_wait_seconds).", "s",
                   (_quantile(0.5, "batchserve_queue_wait_seconds"), "{{model_name}} p50"),
                   (_quantile(0.99, "batchserve_queue_wait_seconds"), "{{model_name}} p99")),
        timeseries("Handler time per batch", "Time a worker's handler spent on one batch: "
                   "p50, p99 (batchserve_handler_seconds).", "s",
                   (_quantile(0.5, "batchserve_handler_seconds"), "{{model_name}} p50"),
                   (_quantile(0.99, "batchserve_handler_seconds"), "{{model_name}} p99")),
        timeseries("Mean latency (TorchServe's counters)", "What TorchServe dashboards plot: "
                   "the microseconds counted by ts_inference_latency_microseconds and "
                   "ts_queue_latency_microseconds over the requests counted.", "µs",
                   (f"{_rate(_m('ts_inference_latency_microseconds'))}\n  /\n"
                    f"{_rate(_m('ts_inference_requests_total'))}", "{{model_name}} inference"),
                   (f"{_rate(_m('ts_queue_latency_microseconds'))}\n  /\n"
                    f"{_rate(_m('ts_inference_requests_total'))}", "{{model_name}} queue")),
        timeseries("Where the time went (mean per phase)", "A request's time split: queue, "
                   "batch forming, worker, the handler's preprocess / inference / "
                   "postprocess, and the frontend's own (batchserve_request_phase_seconds).",
                   "s", (_mean("batchserve_request_phase_seconds", "phase"), "{{phase}}"),
                   stack=True),
        timeseries("p99 per phase", "99th percentile of each phase of a request "
                   "(batchserve_request_phase_seconds).", "s",
                   (_quantile(0.99, "batchserve_request_phase_seconds", "phase"),
                    "{{phase}}")),
        timeseries("TorchServe's timing gauges", "The last values TorchServe's gauges hold: "
                   "QueueTime (the last request's wait), WorkerThreadTime (the frontend's time "
                   "on the last batch), and what handlers report: PredictionTime and "
                   "HandlerTime (TorchServe's built-in handlers).", "ms",
                   (f"max({_h('QueueTime')})", "QueueTime"),
                   (f"max({_h('WorkerThreadTime')})", "WorkerThreadTime"),
                   (f"max by (ModelName) ({_h('PredictionTime', HANDLER_MODEL)})",
                    "{{ModelName}} PredictionTime"),
                   (f"max by (ModelName) ({_h('HandlerTime', HANDLER_MODEL)})",
                    "{{ModelName}} HandlerTime")),
    ]


def batching() -> list[Json]:
    return [
        heatmap("Batch size distribution", "How many requests each batch carried "
                "(batchserve_batch_size), batches per bucket.", "short",
                f"sum by (le) (increase({_m('batchserve_batch_size_bucket')}[{RATE}]))"),
        timeseries("Mean batch size", "Requests per batch, per model.", "short",
                   (_mean("batchserve_batch_size"), "{{model_name}}")),
        heatmap("Batch fill distribution", "Each batch's size over the model's batch_size "
                "(batchserve_batch_fill): 1 is a full batch.", "percentunit",
                f"sum by (le) (increase({_m('batchserve_batch_fill_bucket')}[{RATE}]))"),
        timeseries("Mean batch fill", "Each model's mean batch size over its batch_size "
                   "(batchserve_batch_fill): 100% means every batch left full.", "percentunit",
                   (_mean("batchserve_batch_fill"), "{{model}}")),
        timeseries("Why batches left", "Batches dispatched per second by reason: full, "
                   "max_delay (maxBatchDelay reached), adaptive (nobody else was coming), "
                   "deadline, slot_free (a second batch slot was free), sequence "
                   "(batchserve_dispatch_total).", "ops",
                   (_rate(_m("batchserve_dispatch_total"), "reason"), "{{reason}}"),
                   stack=True),
        timeseries("Batches/s", "Batches the workers ran per second, per model.", "ops",
                   (_rate(_m("batchserve_batch_size_count")), "{{model_name}}")),
        timeseries("Queue depth", "Requests waiting in each model's queue.", "short",
                   (f"sum by (model_name) ({_m('batchserve_queue_depth')})",
                    "{{model_name}}")),
    ]


def workers() -> list[Json]:
    return [
        timeseries("Workers per model", "Worker processes per model.", "short",
                   (f"sum by (model_name) ({_m('batchserve_workers')})", "{{model_name}}")),
        timeseries("Worker restarts", "Worker restarts (crashes, hangs, failed loads) per "
                   "model.", "short",
                   (f"sum by (model_name) "
                    f"(increase({_m('batchserve_worker_restarts_total')}[{RATE}]))",
                    "{{model_name}}"), bars=True),
        bargauge("Worker load time", "Milliseconds from each worker's start to its model "
                 "loaded, the last load (TorchServe's WorkerLoadTime).", "ms",
                 (f"max by (WorkerName) ({_h('WorkerLoadTime')})", "{{WorkerName}}")),
    ]


def host() -> list[Json]:
    return [
        timeseries("CPU, memory and disk", "The host as TorchServe's system metrics measure "
                   "it, every metric_time_interval (60 s).", "percent",
                   (f"max by (instance) ({_h('CPUUtilization')})", "{{instance}} CPU"),
                   (f"max by (instance) ({_h('MemoryUtilization')})", "{{instance}} memory"),
                   (f"max by (instance) ({_h('DiskUtilization')})", "{{instance}} disk")),
        timeseries("Memory", "Memory used and available on the host, in MiB.", "mbytes",
                   (f"max by (instance) ({_h('MemoryUsed')})", "{{instance}} used"),
                   (f"max by (instance) ({_h('MemoryAvailable')})", "{{instance}} available")),
        timeseries("GPU utilisation", "Per GPU (DeviceId), on hosts with GPUs: compute and "
                   "memory utilisation.", "percent",
                   (f"max by (instance, DeviceId) ({_h('GPUUtilization')})",
                    "{{instance}} GPU {{DeviceId}}"),
                   (f"max by (instance, DeviceId) ({_h('GPUMemoryUtilization')})",
                    "{{instance}} GPU {{DeviceId}} memory")),
        timeseries("GPU memory used", "Per GPU (DeviceId), on hosts with GPUs, in MiB.", "mbytes",
                   (f"max by (instance, DeviceId) ({_h('GPUMemoryUsed')})",
                    "{{instance}} GPU {{DeviceId}}")),
    ]


ROWS: list[tuple[str, Any, int, int]] = [
    # title, panels, panel width, panel height
    ("Overview", overview, 4, 4),
    ("Traffic and errors", traffic, 12, 8),
    ("Latency", latency, 12, 8),
    ("Batching", batching, 12, 8),
    ("Workers", workers, 8, 8),
    ("Host", host, 12, 8),
]


def _variable(name: str, label: str, query: str) -> Json:
    return {"type": "query", "name": name, "label": label, "datasource": DATASOURCE,
            "query": query, "refresh": 2, "sort": 1, "multi": True, "includeAll": True,
            "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "options": []}


def build() -> Json:
    """The dashboard (Grafana's classic JSON model, schemaVersion 39)."""
    panels: list[Json] = []
    next_id = 1
    y = 0
    for title, make, width, height in ROWS:
        panels.append({"type": "row", "title": title, "collapsed": False, "id": next_id,
                       "panels": [], "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        next_id += 1
        y += 1
        x = 0
        for panel in make():
            if x + width > 24:
                x, y = 0, y + height
            panel["id"] = next_id
            panel["gridPos"] = {"h": height, "w": width, "x": x, "y": y}
            panels.append(panel)
            next_id += 1
            x += width
        y += height
    variables = [
        {"type": "datasource", "name": "datasource", "label": "Data source",
         "query": "prometheus", "refresh": 1, "multi": False, "includeAll": False,
         "options": []},
        _variable("job", "Job", "label_values(batchserve_workers, job)"),
        _variable("instance", "Instance", 'label_values(batchserve_workers{job=~"$job"}, '
                  "instance)"),
        _variable("model", "Model", 'label_values(batchserve_workers{job=~"$job",'
                  'instance=~"$instance"}, model_name)'),
    ]
    return {
        "uid": UID, "title": "batchserve", "description": "batchserve (and TorchServe) "
        "metrics: traffic, errors, latency, batching, workers, host. Source: deploy/grafana "
        "in the batchserve repository.",
        "tags": ["batchserve", "torchserve", "inference"], "timezone": "browser",
        "editable": True, "graphTooltip": 1, "time": {"from": "now-1h", "to": "now"},
        "timepicker": {}, "refresh": "30s", "schemaVersion": 39, "version": 1,
        "fiscalYearStartMonth": 0, "liveNow": False, "weekStart": "",
        "links": [], "panels": panels,
        "templating": {"list": variables},
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard"}]},
    }


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    OUTPUT.write_text(render(), encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
