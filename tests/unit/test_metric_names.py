"""What a handler's metric may be called and how much of the page it may take (issue 31, item
6): names, units and label names checked in full with TorchServe's rules; the server's own
names and names Prometheus reads as another refused, in every metrics_mode; label values cut
and label sets bounded; and the whole page parsing whatever handlers report."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from frontend.errors import ConfigError
from frontend.observe import model_metrics
from frontend.observe.families import MAX_LABEL_SETS
from frontend.observe.metric_specs import (
    MAX_DIMENSIONS,
    SERVER_PREFIX,
    MetricSpec,
    handler_problem,
    load_metrics_config,
    prometheus_problem,
)
from frontend.observe.metrics import HOSTNAME, METRICS_MODES, ServerMetrics
from protos import worker_pb2
from tests.metrics_page import parsed_page


def _metric(name: str, value: float = 1.0, kind: str = "counter", unit: str = "Count",
            dims: tuple[tuple[str, str], ...] = ()) -> worker_pb2.Metric:
    return worker_pb2.Metric(name=name, unit=unit, type=kind, value=value,
                             dimension_names=[n for n, _ in dims],
                             dimension_values=[v for _, v in dims], request_id="r")


def _spec(name: str, *dims: str, kind: str = "counter", unit: str = "Count") -> MetricSpec:
    return MetricSpec(name, unit, kind, (*dims, "Hostname"))


def test_names_are_checked_in_full() -> None:
    """``re.match`` with ``$`` let ``"t4_nl\\n"`` through; every rule is a full match."""
    for name in ("t4_nl\n", "t4_nl\r", "t4 nl", "a:b", "9lives", "é", "", "x" * 129, "a\n b"):
        assert handler_problem(_spec(name)) is not None, repr(name)
    for name in ("t4_nl", "_x", "X9", "x" * 128):
        assert handler_problem(_spec(name)) is None, name
    assert prometheus_problem(MetricSpec("t4_nl\n", "c", "gauge", ())) is not None
    assert prometheus_problem(MetricSpec("ok", "c", "gauge", ("x\n",))) is not None
    assert prometheus_problem(MetricSpec("a:b", "c", "gauge", ("x",))) is None
    for unit in ("req/s", "ms\n", "u" * 65, "%"):
        assert handler_problem(_spec("M", unit=unit)) is not None, unit
    for unit in ("", "ms", "Milliseconds", "count per batch"):
        assert handler_problem(_spec("M", unit=unit)) is None, unit


def test_a_handlers_dimensions_are_prometheus_labels_none_twice() -> None:
    bad = [("Hostname",), ("Tag", "Tag"), ("bad-label",), ("__x",), ("nl\n",), ("",),
           ("x" * 129,), tuple(f"D{i}" for i in range(MAX_DIMENSIONS + 1))]
    for dims in bad:
        assert handler_problem(_spec("M", *dims)) is not None, dims
    assert handler_problem(_spec("H", "le", kind="histogram")) is not None
    assert handler_problem(_spec("G", "le", kind="gauge")) is None
    assert handler_problem(_spec("M", "hostname", *(f"D{i}" for i in range(15)))) is None


#: Names of the server's own metrics, or names Prometheus' parser reads as one of them, each
#: with a type a handler might give it.
SERVER_NAMES = [("Requests2XX", "counter"), ("Requests2XX", "gauge"),
                ("ts_inference_requests_total", "counter"),
                ("ts_inference_requests", "gauge"), ("Requests2XX_total", "counter"),
                ("Requests4XX_total", "gauge"), ("QueueTime_total", "counter"),
                ("QueueTime", "histogram"), ("batchserve_queue_depth", "gauge"),
                ("batchserve_batch_size_count", "gauge"), ("batchserve_anything", "counter"),
                ("GPUUtilization", "gauge"), ("WorkerLoadTime_created", "gauge")]


@pytest.mark.parametrize("mode", METRICS_MODES)
def test_the_servers_own_names_are_refused_in_every_mode(
        mode: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A configuration that declares none of the host's metrics: TorchServe's names stay its.
    config = tmp_path / "m.yaml"
    config.write_text("ts_metrics: {counter: [{name: Requests2XX, unit: Count, "
                      "dimensions: [Level]}]}\n")
    metrics = ServerMetrics(mode=mode, config=load_metrics_config(config),
                            auto_detect=True, system_metrics=False)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            metrics.record_model_metrics(
                [_metric(name, 424242, kind, dims=(("Level", "Model"),))
                 for name, kind in SERVER_NAMES])
    assert metrics.handlers.metrics == {}
    for name, _ in SERVER_NAMES:
        said = [r.getMessage() for r in caplog.records if f"'{name}' is dropped" in r.getMessage()]
        assert len(said) == 1, (name, said)
    assert b"424242" not in metrics.exposition()


def test_handler_metrics_prometheus_reads_as_one_are_kept_once(
        caplog: pytest.LogCaptureFixture) -> None:
    metrics = ServerMetrics(auto_detect=True, system_metrics=False)
    with caplog.at_level(logging.WARNING):
        metrics.record_model_metrics([
            _metric("Pair", 1), _metric("Pair_total", 5, "gauge"), _metric("Pair", 5, "gauge"),
            _metric("Lat", 1, "histogram"), _metric("Lat_count", 7, "gauge"),
            _metric("Lat_bucket", 7, "counter"), _metric("Solo_total", 1),
            _metric("Solo", 2, "gauge")])
    assert set(metrics.handlers.metrics) - set(metrics.config.model_metrics) == {
        "Lat", "Pair", "Solo_total"}
    assert any("collides with the metric Pair" in r.getMessage() for r in caplog.records)
    samples = parsed_page(metrics.exposition().decode())
    assert [s.value for s in samples["Pair"]] == [6.0]  # the gauge's 5 added to the counter
    assert [s.value for s in samples["Solo"]] == [1.0]


def test_a_configuration_whose_metrics_collide_or_break_the_rules_stops_the_start(
        tmp_path: Path) -> None:
    bad = {
        "model_metrics: {counter: [{name: Requests2XX, unit: c, dimensions: []}]}":
            "name of the metric Requests2XX",
        "model_metrics: {counter: [{name: ts_inference_requests, unit: c, dimensions: []}]}":
            "collides with the metric ts_inference_requests_total",
        "model_metrics: {gauge: [{name: batchserve_x, unit: c, dimensions: []}]}":
            "batchserve_",
        'model_metrics: {gauge: [{name: "t4_nl\\n", unit: c, dimensions: []}]}':
            "not a metric name",
        "model_metrics: {gauge: [{name: G, unit: c, dimensions: [Hostname]}]}": "Hostname",
        "model_metrics: {counter: [{name: A, unit: c, dimensions: []}], "
        "gauge: [{name: A_total, unit: c, dimensions: []}]}": "collides with the metric A",
        "ts_metrics: {gauge: [{name: batchserve_queue_depth, unit: c, dimensions: []}]}":
            "batchserve_",
        "ts_metrics: {counter: [{name: B, unit: c, dimensions: []}], "
        "gauge: [{name: B_created, unit: c, dimensions: []}]}": "collides with the metric B",
    }
    path = tmp_path / "m.yaml"
    for text, message in bad.items():
        path.write_text(text)
        for mode in METRICS_MODES:
            with pytest.raises(ConfigError, match=message):
                ServerMetrics(mode=mode, config=load_metrics_config(path),
                              system_metrics=False)
    ServerMetrics(system_metrics=False)  # TorchServe's default configuration is fine


def test_the_servers_own_families_all_begin_with_the_reserved_prefix() -> None:
    """The prefix handlers may not use covers every family that is ours, not TorchServe's."""
    metrics = ServerMetrics(system_metrics=False)
    torchserve = set(metrics.config.ts_metrics) | set(metrics.config.model_metrics)
    ours = [family.name for family in metrics.families() if family.name not in torchserve]
    assert ours and all(name.startswith(SERVER_PREFIX) for name in ours), ours


def test_label_values_are_cut_and_label_sets_bounded(caplog: pytest.LogCaptureFixture) -> None:
    """1,000 label values of 20 kB made a 20 MB page."""
    metrics = ServerMetrics(auto_detect=True, system_metrics=False)
    with caplog.at_level(logging.WARNING):
        metrics.record_model_metrics(
            [_metric("Flood", 1, "gauge", dims=(("Value", f"{i:05d}" + "v" * 20_000),))
             for i in range(MAX_LABEL_SETS + 10)])
    page = metrics.exposition()
    assert len(page) < 400_000
    [samples] = [parsed_page(page.decode())["Flood"]]
    assert len(samples) == MAX_LABEL_SETS
    assert {len(s.labels["Value"]) for s in samples} == {model_metrics.MAX_LABEL_VALUE_CHARS}
    assert {s.labels["Hostname"] for s in samples} == {HOSTNAME}
    said = [r.getMessage() for r in caplog.records]
    assert sum("is cut" in line for line in said) == 1
    assert sum("label sets, the most" in line for line in said) == 1


def test_all_handler_metrics_together_take_a_bounded_part_of_the_page(
        caplog: pytest.LogCaptureFixture) -> None:
    metrics = ServerMetrics(auto_detect=True, system_metrics=False)
    before = len(metrics.exposition())
    with caplog.at_level(logging.WARNING):
        for number in range(model_metrics.MAX_AUTO_DETECTED + 5):
            metrics.record_model_metrics(
                [_metric(f"Wide{number}", 1, "histogram",
                         dims=tuple((f"D{d}", f"{i}".ljust(256, "w")) for d in range(16)))
                 for i in range(20)])
    page = metrics.exposition()
    assert len(page) - before <= model_metrics.MAX_PAGE_BYTES
    assert len(page) - before > model_metrics.MAX_PAGE_BYTES * 0.8  # it is the budget that bit
    said = [r.getMessage() for r in caplog.records]
    assert sum("take all the metrics page may give them" in line for line in said) == 1
    assert sum(f"handlers added {model_metrics.MAX_AUTO_DETECTED}" in line for line in said) == 5


def test_the_page_parses_whatever_handlers_report() -> None:
    names = ["t4_nl\n", "ok", "q\"x", "a{b}", "# TYPE x gauge", "Requests2XX", "x y", "le"]
    labels = [*names, "Tag", "Hostname"]
    values = ['q"uote', "back\\slash\\", "new\nline", "}} 1.0\nforged 2.0", "\u2028\x00\r",
              "\x1b[2J", "", ",", "=", "\\n", "\\\""]
    metrics = ServerMetrics(auto_detect=True, system_metrics=False)
    reported = []
    for kind in ("counter", "gauge", "histogram"):
        for name in names:
            for number, label in enumerate(labels):
                metric = f"ok_{kind}_{number}" if name == "ok" else name
                reported += [_metric(metric, 1, kind, dims=((label, value),)) for value in values]
    metrics.record_model_metrics(reported)
    families = parsed_page(metrics.exposition().decode())
    kept = {name for name in families if name.startswith("ok_")}
    # The label names: "le" too, but not a histogram's.
    assert kept == {f"ok_{kind}_{labels.index(label)}" for kind in ("counter", "gauge", "histogram")
                    for label in ("ok", "Requests2XX", "Tag", "le")
                    if (kind, label) != ("histogram", "le")}
    assert {s.labels["Tag"] for s in families[f"ok_gauge_{labels.index('Tag')}"]} == set(values)
    assert "forged" not in families


def test_a_value_cannot_add_a_dimension_or_a_host_to_a_metric_log_line(tmp_path: Path) -> None:
    metrics = ServerMetrics(mode="log", auto_detect=True, system_metrics=False,
                            log_dir=tmp_path)

    async def report() -> None:
        await metrics.start()
        metrics.record_model_metrics([_metric(
            "Said", 2, "gauge", dims=(("Text", "a,Level:Forged|#hostname:evil\n424242"),))])
        await metrics.close()

    asyncio.run(report())
    [line] = (tmp_path / "model_metrics.log").read_text().splitlines()
    body = line.split(" - ", 1)[1]
    assert body.startswith("Said.Count:2.0|#Text:a\\x2cLevel\\x3aForged\\x7c#hostname\\x3aevil"
                           "\\n424242|#hostname:"), body
    assert body.count("|#") == 2 and body.count(",") == 2  # host, request id, timestamp
