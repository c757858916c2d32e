"""The serving core's observers against the real server (a real worker, real HTTP clients):
with every observer that has a switch turned off (request phases, dispatch reasons, the
access log; traces are off by default) the server answers as before, what is always kept
(the metrics' latency and batch sizes, describe's recent batches, the live page's busy time)
is still kept from the core's events, and the switched-off records stay empty."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families


def test_with_the_observers_off_the_server_answers_and_keeps_only_what_is_always_kept(
        build_mar, start_server, model_store: Path) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar", request_phases=False, dispatch_stats=False,
                          enable_access_log=False)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: server.predict("echo", b"r%d" % i), range(12)))
    assert [answer.content for answer in answers] == [b"r%d" % i for i in range(12)]

    def batching() -> dict[str, object]:
        return server.describe("echo")["batching"]  # type: ignore[return-value]

    # Told as each batch ends, once its answers are delivered: counted within moments.
    server.wait_for(lambda: batching()["requestsTotal"] == 12, "describe's twelve requests")
    described = batching()
    assert 1 <= described["batchesTotal"] <= 12  # type: ignore[operator]
    assert sum(described["recentBatchSizes"]) == 12  # type: ignore[arg-type]
    assert described["dispatchReasons"] == {}  # dispatch_stats=false: nobody was told
    assert described["batchFill"]["batches"] == 0  # type: ignore[index]

    text = requests.get(f"{server.metrics}/metrics", timeout=10).text
    samples = {sample.name: sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.labels.get("model_name") == "echo" and "le" not in sample.labels}
    assert samples["batchserve_request_latency_seconds_count"] == 12
    assert samples["batchserve_batch_size_sum"] == 12
    assert samples["ts_inference_requests_total"] == 12
    assert not [name for name in samples if name.startswith((
        "batchserve_request_phase_seconds", "batchserve_dispatch_total",
        "batchserve_batch_fill"))]
    assert not (model_store.parent / "logs" / "access_log.log").exists()

    def busy_on_the_live_page() -> bool:
        """Keep the worker busy a moment, then: does the page's last sample show it busy?"""
        for _ in range(20):
            assert server.predict("echo", b"x").status_code == 200
        data = requests.get(f"{server.management}/dashboard/data", timeout=10).json()
        rows = [row for sample in data["samples"][-1:] for row in sample["models"]
                if row["model"] == "echo"]
        return any(value and value > 0 for row in rows for value in row.get("busy", {}).values())

    # The live page's sampler (once a second): the worker's busy time, from the batches' ends.
    server.wait_for(busy_on_the_live_page, "the worker's busy time on the live page")
