"""The live page's pieces without a server: the ring of samples, percentiles from histogram
buckets, the sampler over the server's real metrics and busy time, told of calls and batches
as the serving core tells them (with stand-ins for the models' and workers' status, and
simulated time), and the page's routes and headers through the management app."""

from __future__ import annotations

import ast
import asyncio
import base64
import dataclasses
import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from frontend.api.http.dashboard import PAGE_FILE, page_headers
from frontend.api.http.management import ManagementApp
from frontend.errors import QueueFull
from frontend.observe.dashboard import MAX_MODELS, RESCAN_S, BusyTime, Dashboard
from frontend.observe.events import Batch, CallFacts, JobFacts, ModelEvents, Observers, Origin
from frontend.observe.exposition import Family
from frontend.observe.metrics import ServerMetrics
from frontend.observe.status import ModelStatus, Statuses, WorkerStatus
from frontend.observe.timeseries import (
    Buckets,
    Ring,
    by_label,
    by_model,
    of_model,
    read_counters,
    read_histograms,
)
from frontend.ops.auth import TokenAuthority
from frontend.server import statuses
from protos import worker_pb2
from tests.unit.services import call, make_services

ROOT = Path(__file__).resolve().parent.parent.parent
PAGE = ROOT / "frontend" / "api" / "http" / PAGE_FILE

# ---- the ring and the arithmetic ---------------------------------------------------------------


def test_the_ring_keeps_the_last_samples_and_answers_since() -> None:
    ring: Ring[int] = Ring(3)
    for second in range(1, 6):
        ring.append(float(second), second * 10)
    assert len(ring) == 3
    assert ring.since(None) == [(3.0, 30), (4.0, 40), (5.0, 50)]
    assert ring.since(3.0) == [(4.0, 40), (5.0, 50)]
    assert ring.since(5.0) == []
    assert ring.since(0.0) == [(3.0, 30), (4.0, 40), (5.0, 50)]


def test_quantiles_interpolate_within_the_bucket_as_prometheus_does() -> None:
    # 10 observations: 4 in (0, 1], 4 in (1, 2], 2 above 4.
    buckets = Buckets((1.0, 2.0, 4.0), (4.0, 8.0, 8.0, 10.0), 30.0)
    assert buckets.count == 10 and buckets.mean() == 3.0
    assert buckets.quantile(0.2) == pytest.approx(0.5)  # rank 2 of the first 4, in (0, 1]
    assert buckets.quantile(0.6) == pytest.approx(1.5)  # rank 6: half way through (1, 2]
    assert buckets.quantile(0.99) == 4.0  # above every finite bound: the highest bound
    assert Buckets((1.0,), (0.0, 0.0), 0.0).quantile(0.5) is None


def test_a_reading_minus_the_one_before_is_what_was_observed_in_between() -> None:
    before = Buckets((1.0, 2.0), (1.0, 3.0, 3.0), 4.0)
    now = Buckets((1.0, 2.0), (1.0, 7.0, 8.0), 20.0)
    between = now.since(before)
    assert between.cumulative == (0.0, 4.0, 5.0) and between.total == 16.0
    assert now.since(None) is now
    # A series that went back (a restarted counter) counts from zero.
    assert before.since(now) is before


def test_our_histograms_and_counters_read_back_from_their_families() -> None:
    metrics = ServerMetrics(system_metrics=False)
    observers = _subscribed(metrics)
    for latency_s in (0.002, 0.003, 0.2):
        _end(observers, _call(("m", "1.0"), latency_s))
    series = read_histograms(metrics.latency.family())
    (labels, only), = series.items()
    assert dict(labels) == {"model_name": "m", "model_version": "1.0"}
    assert only.count == 3 and only.total == pytest.approx(0.205)
    assert 0.0025 <= only.quantile(0.5) <= 0.005  # type: ignore[operator]
    # A counter labelled as issue 26's names say (model, reason), read per model.
    reasons = Family("batchserve_dispatch_total", "", "counter")
    reasons.add(("model", "reason"), ("m", "full"), 5.0)
    reasons.add(("model", "reason"), ("m", "max_delay"), 2.0)
    reasons.add(("model", "reason"), ("other", "full"), 9.0)
    counts = by_label(of_model(by_model(read_counters(reasons)), "m", "1.0"), "reason")
    assert counts == {"full": 5.0, "max_delay": 2.0}
    # A model_version label must match.
    assert of_model(by_model(series), "m", "2.0") == []


# ---- the sampler --------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeWorker:
    """A worker slot as the sampler reads it (its ``WorkerStatus``)."""

    def __init__(self, worker_id: str) -> None:
        self.id = worker_id
        self.in_flight = 0
        self.is_up = True
        self.restarts = 0
        self.pid = 4242
        self.gpu_id = None
        self.working_since: float | None = None

    def status(self) -> WorkerStatus:
        return WorkerStatus(self.id, "READY", self.is_up, self.in_flight, self.restarts,
                            self.pid, self.gpu_id, self.working_since)


class FakeModel:
    """A model version as the sampler reads it (its ``ModelStatus``)."""

    def __init__(self, name: str, workers: int = 2) -> None:
        self.name, self.version = name, "1.0"
        self.key = (name, self.version)
        self.workers = [FakeWorker(str(i)) for i in range(workers)]
        self.residency = "loaded"
        self.last_used: float | None = None

    def status(self) -> ModelStatus:
        return ModelStatus(self.name, self.version, "Healthy", "adaptive", 4, 50, 3, 100,
                           tuple(worker.status() for worker in self.workers),
                           residency=self.residency, last_used=self.last_used)


def listed(*models: FakeModel) -> Statuses:
    return lambda: [model.status() for model in models]


def fake_model(name: str, workers: int = 2) -> FakeModel:
    return FakeModel(name, workers)


def registered(metrics: ServerMetrics, *models: FakeModel) -> ServerMetrics:
    """``metrics`` with ``models`` registered (their records start: dispatch stats of their
    own; then three batches of 4, 4 and 2 come back)."""
    for model in models:
        metrics.records.registered(model.key)
        for size in (4, 4, 2):
            batch = Batch("full", size, 4, 0.0, 0.0)
            batch.replied = True
            metrics.records.batch_ended(model.key, batch, [_job(0.0)] * size, None)
    return metrics


def page_only_model(name: str) -> FakeModel:
    """A model whose batch fill and dispatch reasons are only on the metrics page (no
    ``DispatchStats`` of its own to read them from: the metrics keep no records of it)."""
    return FakeModel(name, workers=1)


def _subscribed(metrics: ServerMetrics) -> Observers:
    """The events the metrics observe, subscribed as the server subscribes them."""
    observers = Observers()
    metrics.subscribe(observers)
    return observers


def _call(key: tuple[str, str], latency_s: float, error: QueueFull | None = None
          ) -> CallFacts:
    """A prediction of ``key`` that ended after ``latency_s``: answered, or refused with
    ``error``."""
    call = CallFacts(Origin("/127.0.0.1:1", "POST", "/predictions/m", "HTTP/1.1"),
                     JobFacts(worker_pb2.Request()), 0.0)
    call.key, call.latency_s = key, latency_s
    call.status, call.error = (error.http_status, error) if error is not None else (200, None)
    return call


def _end(observers: Observers, call: CallFacts) -> None:
    for observer in observers.call_ended:
        observer(call)


def _job(wait_s: float) -> JobFacts:
    """A request that waited ``wait_s`` in the queue before its batch left (at 1.0)."""
    return JobFacts(worker_pb2.Request(), enqueued_at=1.0 - wait_s)


def _batch_back(events: ModelEvents, size: int, wait_s: float, worker: str = "0",
                service_s: float = 0.0) -> None:
    """A batch of ``size`` requests, each ``wait_s`` in the queue, came back from ``worker``
    after ``service_s`` (its handler's steps not timed: no phases)."""
    batch = Batch("full", size, 4, 1.0, 1.0)
    batch.worker, batch.service_s, batch.replied = worker, service_s, True
    assert events.ended is not None
    events.ended(batch, [_job(wait_s)] * size, worker_pb2.PredictResult())


#: The families of issue 26's timing and reasons part, which the page finds by name.
ISSUE_26_FAMILIES = frozenset({"batchserve_request_phase_seconds", "batchserve_batch_fill",
                               "batchserve_dispatch_total"})


class WithIssue26Families(ServerMetrics):
    """The server's metrics with the families of issue 26's timing and reasons part replaced
    by ``extra`` (set by the test, as the page finds them: by name, on the metrics page)."""

    def __init__(self, extra: list[Family]) -> None:
        super().__init__(system_metrics=False)
        self.extra = extra

    def families(self) -> Iterator[Family]:
        yield from (family for family in super().families()
                    if family.name not in ISSUE_26_FAMILIES)
        yield from self.extra


def _observed(metrics: ServerMetrics, busy: BusyTime, model: FakeModel
              ) -> tuple[Observers, ModelEvents]:
    """The events the metrics and the busy time observe, and ``model``'s hooks."""
    observers = _subscribed(metrics)
    observers.batch_ended.append(busy.batch_ended)
    return observers, observers.of_model(*model.key)


def test_a_sample_holds_the_rates_percentiles_and_utilisation_of_the_second_before_it(
) -> None:
    clock, model, busy = Clock(), fake_model("m"), BusyTime()
    metrics = registered(ServerMetrics(listed(model), system_metrics=False), model)
    observers, events = _observed(metrics, busy, model)
    dashboard = Dashboard(listed(model), metrics, busy=busy, clock=clock, monotonic=clock)
    assert dashboard.tick() is None  # the baseline
    clock.now += 2.0
    for _ in range(10):
        _end(observers, _call(model.key, 0.004))
    _end(observers, _call(model.key, 0.001, error=QueueFull(100)))
    # Worker 0 busy 1.5 s of the 2 (on both batches), the other idle.
    _batch_back(events, 4, 0.001, worker="0", service_s=1.0)
    _batch_back(events, 2, 0.001, worker="0", service_s=0.5)
    sample = dashboard.tick()
    assert sample is not None and sample["t"] == clock.now
    (row,) = sample["models"]  # type: ignore[misc]
    assert row["model"] == "m" and row["queue"] == 3 and row["workersUp"] == 2
    assert row["requests"] == 5.5 and row["refused"] == 0.5
    assert row["batches"] == 1.0 and row["meanBatch"] == 3.0
    latency = row["latencyMs"]
    assert 2.5 <= latency["p50"] <= latency["p90"] <= latency["p99"] <= 5.0
    assert row["busy"] == {"0": 0.75, "1": 0.0} and row["utilisation"] == 0.375
    # Nothing dispatched yet by the dispatch stats: no phases, no fill, no reason counted.
    assert not row.get("phasesMs") and row["fill"] is None
    assert set(row["reasons"].values()) == {0.0}
    # A quiet second: rates are zero, no latency to speak of.
    clock.now += 1.0
    (quiet,) = dashboard.tick()["models"]  # type: ignore[index]
    assert quiet["requests"] == 0.0 and quiet["latencyMs"] is None
    assert quiet["meanBatch"] is None and quiet["busy"] == {"0": 0.0, "1": 0.0}


def test_the_phases_fill_and_reasons_show_once_the_server_keeps_them() -> None:
    # The phases are read from the server's own histogram; the fill and the reasons, for a
    # model without dispatch stats of its own, from the metrics page (replaced here by
    # families the test sets).
    clock, model = Clock(), page_only_model("m")
    fill = Family("batchserve_batch_fill", "", "histogram")
    reasons = Family("batchserve_dispatch_total", "", "counter")
    metrics = WithIssue26Families([fill, reasons])
    dashboard = Dashboard(listed(model), metrics, clock=clock, monotonic=clock)

    def set_counts(count: float) -> None:
        for family in (fill, reasons):
            family.samples.clear()
        for le in ("0.5", "1.0", "+Inf"):
            fill.add(("model_name", "le"), ("m", le), count, "_bucket")
        fill.add(("model_name",), ("m",), count * 0.5, "_sum")
        reasons.add(("model_name", "reason"), ("m", "full"), count)
        reasons.add(("model_name", "reason"), ("m", "max_delay"), count / 2)

    set_counts(0.0)
    dashboard.tick()
    clock.now += 1.0
    set_counts(8.0)
    for _ in range(8):
        metrics.phases.observe(("m", "1.0", "queue"), 0.003)
        metrics.phases.observe(("m", "1.0", "inference"), 0.02)
    (row,) = dashboard.tick()["models"]  # type: ignore[index]
    assert row["phasesMs"]["queue"]["mean"] == pytest.approx(3.0)
    assert row["phasesMs"]["inference"]["mean"] == pytest.approx(20.0)
    # Percentiles interpolate within the bucket each falls in.
    for phase, mean in (("queue", 3.0), ("inference", 20.0)):
        shown = row["phasesMs"][phase]
        assert shown["p50"] <= shown["p99"] and shown["p50"] / mean < 4 and mean / shown["p50"] < 4
    assert row["fill"] == 0.5
    assert row["reasons"] == {"full": 8.0, "max_delay": 4.0}


def test_the_fill_and_reasons_come_from_the_models_own_stats_without_building_the_page(
) -> None:
    # Building the metrics page each second would hold the event loop for milliseconds.
    clock, model = Clock(), fake_model("m", workers=1)
    metrics = registered(ServerMetrics(listed(model), system_metrics=False), model)
    events = _subscribed(metrics).of_model(*model.key)
    built = []
    original = metrics.families

    def families() -> Iterator[Family]:
        built.append(clock.now)
        return original()

    metrics.families = families  # type: ignore[method-assign]
    dashboard = Dashboard(listed(model), metrics, clock=clock, monotonic=clock)
    dashboard.tick()
    assert events.formed is not None
    for reason, items in (("full", 4), ("full", 4), ("adaptive", 1), ("deadline", 2)):
        events.formed(Batch(reason, items, 4, 0.0, 0.0))
    clock.now += 2.0
    (row,) = dashboard.tick()["models"]  # type: ignore[index]
    assert row["reasons"]["full"] == 1.0 and row["reasons"]["adaptive"] == 0.5
    assert row["reasons"]["deadline"] == 0.5 and row["reasons"]["max_delay"] == 0.0
    assert row["fill"] == pytest.approx(0.6875)
    assert built == []


def test_a_family_found_later_starts_its_rates_from_the_next_sample() -> None:
    """The metrics page is searched for a family it has not had every RESCAN_S only; once
    found, its first reading holds everything since the server started: no rate from it."""
    clock, model = Clock(), page_only_model("m")
    reasons = Family("batchserve_dispatch_total", "", "counter")
    metrics = WithIssue26Families([])
    dashboard = Dashboard(listed(model), metrics, clock=clock, monotonic=clock)
    dashboard.tick()  # searched: not there
    reasons.add(("model_name", "reason"), ("m", "full"), 500.0)  # the server counted them all along
    metrics.extra.append(reasons)
    clock.now += 1.0
    (row,) = dashboard.tick()["models"]  # type: ignore[index]
    assert "reasons" not in row  # not searched again yet
    clock.now += RESCAN_S
    (row,) = dashboard.tick()["models"]  # type: ignore[index]
    assert "reasons" not in row  # found: the baseline
    reasons.samples.clear()
    reasons.add(("model_name", "reason"), ("m", "full"), 503.0)
    clock.now += 1.0
    (row,) = dashboard.tick()["models"]  # type: ignore[index]
    assert row["reasons"] == {"full": 3.0}  # read each second from now on


def test_the_history_is_bounded_and_served_since_a_time() -> None:
    clock, models = Clock(), [fake_model(f"m{i:02}", workers=1) for i in range(MAX_MODELS + 3)]
    metrics = registered(ServerMetrics(listed(*models), system_metrics=False), *models)
    dashboard = Dashboard(listed(*models), metrics, window_s=5, clock=clock, monotonic=clock)
    for _ in range(9):
        dashboard.tick()
        clock.now += 1.0
    assert len(dashboard.samples) == 5
    document = dashboard.document()
    times = [sample["t"] for sample in document["samples"]]  # type: ignore[attr-defined]
    assert times == [1004.0, 1005.0, 1006.0, 1007.0, 1008.0]
    # Every model is listed; the history follows the first MAX_MODELS.
    assert len(document["models"]) == MAX_MODELS + 3  # type: ignore[arg-type]
    assert len(document["samples"][-1]["models"]) == MAX_MODELS  # type: ignore[index]
    newer = dashboard.document(since=1006.0)["samples"]
    assert [sample["t"] for sample in newer] == [1007.0, 1008.0]  # type: ignore[index]
    state = document["models"][0]  # type: ignore[index]
    assert state["model"] == "m00" and state["batchSize"] == 4
    assert state["recentBatchSizes"] == [4, 4, 2]
    assert state["workers"] == [{"id": "0", "state": "READY", "inFlight": 0, "restarts": 0,
                                 "pid": 4242, "gpuId": None}]
    json.dumps(document)  # what the route sends


def test_each_sample_and_the_models_now_carry_their_residency() -> None:
    """The live page plots residency over time from the samples (issue 36): each model's
    state in each second, and its state and last use now."""
    clock, hot, cold = Clock(), fake_model("hot", workers=1), fake_model("cold", workers=0)
    cold.residency = "paged_out"
    metrics = registered(ServerMetrics(listed(hot, cold), system_metrics=False), hot, cold)
    dashboard = Dashboard(listed(hot, cold), metrics, clock=clock, monotonic=clock)
    dashboard.tick()
    for residency in ("loading", "loaded", "evicting", "paged_out"):
        clock.now += 1.0
        hot.last_used = clock.now - 0.25
        cold.residency = residency
        dashboard.tick()
    document = dashboard.document()
    history = [{row["model"]: row["residency"] for row in sample["models"]}
               for sample in document["samples"]]  # type: ignore[attr-defined]
    assert history == [{"cold": state, "hot": "loaded"}
                       for state in ("loading", "loaded", "evicting", "paged_out")]
    now = {model["model"]: (model["residency"], model["lastUsed"])
           for model in document["models"]}  # type: ignore[attr-defined]
    assert now == {"cold": ("paged_out", None), "hot": ("loaded", 1003.75)}
    json.dumps(document)
    # A status made without residency (a server without limits): every model loaded.
    assert ModelStatus("m", "1.0", "Healthy", "adaptive", 1, 0, 0, 100).residency == "loaded"


def test_samples_are_taken_on_the_interval_boundaries_never_twice_in_a_moment() -> None:
    dashboard = Dashboard(listed(), ServerMetrics(system_metrics=False))
    assert dashboard.next_delay_s(100.25) == pytest.approx(0.75)
    assert dashboard.next_delay_s(100.0) == pytest.approx(1.0)
    # A timer that woke a millisecond early waits for the next boundary but one.
    assert dashboard.next_delay_s(100.999) == pytest.approx(1.001)


def test_gpu_readings_join_each_sample() -> None:
    clock, model = Clock(), fake_model("m", workers=1)
    metrics = registered(ServerMetrics(listed(model), system_metrics=False), model)

    def gpus(count: int) -> list[tuple[str, tuple[str, ...], float]]:
        assert count == 1
        return [("GPUMemoryUtilization", ("Host", "0"), 12.0),
                ("GPUMemoryUsed", ("Host", "0"), 5120.0), ("GPUUtilization", ("Host", "0"), 37.0)]

    async def run() -> dict[str, Any]:
        dashboard = Dashboard(listed(model), metrics, gpu_count=1, clock=clock, monotonic=clock,
                              gpu_reader=gpus, interval_s=0.01, gpu_interval_s=0.01)
        dashboard.start()
        try:
            for _ in range(500):
                await asyncio.sleep(0.01)
                clock.now += 1.0
                samples = [s for _, s in dashboard.samples.since(None) if "gpus" in s]
                if samples:
                    return samples[-1]
            raise AssertionError("no sample with GPU readings")
        finally:
            await dashboard.close()

    sample = asyncio.run(run())
    assert sample["gpus"] == [{"id": 0, "memUtil": 12.0, "memUsedMiB": 5120.0, "util": 37.0}]


# ---- the page and its routes ------------------------------------------------------------------


def test_the_page_is_package_data_and_its_csp_allows_only_its_own_script_and_style() -> None:
    tree = ast.parse((ROOT / "setup.py").read_text())
    package_data = next(node.value for node in ast.walk(tree)
                        if isinstance(node, ast.keyword) and node.arg == "package_data")
    assert ast.literal_eval(package_data)["frontend.api.http"] == ["*.html"]
    page = PAGE.read_text()
    headers = dict(page_headers(page.encode()))
    policy = headers[b"content-security-policy"].decode()
    for tag in ("script", "style"):
        (inline,) = re.findall(rf"<{tag}>(.*?)</{tag}>", page, flags=re.DOTALL)
        digest = base64.b64encode(hashlib.sha256(inline.encode()).digest()).decode()
        assert f"{tag}-src 'sha256-{digest}'" in policy
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert "frame-ancestors 'none'" in policy and "unsafe" not in policy
    # What it writes into the page is text, never markup; it loads nothing from elsewhere.
    assert "innerHTML" not in page and "outerHTML" not in page and "eval(" not in page
    assert not re.search(r"<script[^>]+src|https?://(?!www\.w3\.org/2000/svg)", page)


def _dashboard_services(tmp_path: Path, auth: TokenAuthority | None = None) -> Any:
    services = make_services(tmp_path)
    return dataclasses.replace(services, auth=auth, dashboard=Dashboard(
        statuses(services.registry), services.metrics))


def test_without_token_authorization_the_data_needs_no_key(tmp_path: Path) -> None:
    async def run() -> None:
        app = ManagementApp(_dashboard_services(tmp_path))
        page = await call(app, "GET", "/dashboard")
        assert page.status == 200 and page.headers[b"content-type"].startswith(b"text/html")
        assert b"content-security-policy" in page.headers
        data = await call(app, "GET", "/dashboard/data", query=b"since=12.5")
        assert data.status == 200 and data.headers[b"cache-control"] == b"no-store"
        assert set(data.json()) == {"now", "intervalS", "windowS", "gpus", "models", "samples",
                                    "devices", "tenants"}
        assert (await call(app, "GET", "/dashboard/data", query=b"since=soon")).status == 400
        assert (await call(app, "GET", "/dashboard/data", query=b"since=nan")).status == 400
        assert (await call(app, "POST", "/dashboard/data")).status == 405
        assert (await call(app, "GET", "/dashboard/other")).status == 404

    asyncio.run(run())


def test_with_token_authorization_the_data_needs_the_management_key(tmp_path: Path) -> None:
    async def run() -> None:
        auth = TokenAuthority(tmp_path / "key_file.json", 60)
        auth.start()
        keys = json.loads(auth.path.read_text())
        app = ManagementApp(_dashboard_services(tmp_path, auth))
        assert (await call(app, "GET", "/dashboard")).status == 200  # the page has no data
        for headers in ([], [(b"authorization", b"Bearer " + keys["inference"]["key"].encode())]):
            refused = await call(app, "GET", "/dashboard/data", headers=headers)
            assert refused.status == 401 and refused.json()["code"] == 401
        management = [(b"authorization", b"Bearer " + keys["management"]["key"].encode())]
        assert (await call(app, "GET", "/dashboard/data", headers=management)).status == 200

    asyncio.run(run())
