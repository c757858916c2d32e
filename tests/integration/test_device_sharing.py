"""Models that share a device share its time by weight (issue 35, item 5), against the real
server: the simulated accelerator (benchmarks/handlers/accelerator.py, one batch at a time on a
lock file shared by the workers), two models in one ``deviceGroup``, open-loop load from
benchmarks/tenants.py that keeps both backlogged, and the device time read from the metrics
page while both are."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import requests

from benchmarks import tenants
from model_archiver.packaging import ArchiveOptions, build_archive
from tests.conftest import RunningServer

#: A batch of n costs 40 + 2·n ms: 8 requests in 56 ms, about 140 requests/s for the device
#: (slow enough that the load generator, in the server's process, keeps its schedule).
OVERHEAD_MS, PER_ITEM_MS = 40, 2
RATE = 120.0  # per model: together about 1.7x the device
WINDOW_S = (0.6, 2.2)  # when the device time is read (both models backlogged)


@pytest.fixture
def accelerator(model_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BENCH_ACCEL_OVERHEAD_MS", str(OVERHEAD_MS))
    monkeypatch.setenv("BENCH_ACCEL_PER_ITEM_MS", str(PER_ITEM_MS))
    monkeypatch.setenv("BENCH_ACCEL_DEVICE", str(tmp_path / "device.lock"))
    for name in ("hot", "cold", "solo"):
        build_archive(ArchiveOptions(model_name=name, version="1.0",
                                     handler=str(tenants.HANDLER), export_path=model_store,
                                     force=True))
    return model_store


def _register(server: RunningServer, name: str, **params: object) -> None:
    answer = requests.post(f"{server.management}/models", params={
        "url": f"{name}.mar", "batch_size": 8, "max_batch_delay": 5, "initial_workers": 1,
        "synchronous": "true", **params}, timeout=120)
    assert answer.status_code == 200, answer.text


def _shares_while_backlogged(server: RunningServer, streams: list[tenants.Stream]
                             ) -> tuple[dict[str, float], dict[str, tenants.Tally]]:
    """Each model's share of the device time used between WINDOW_S[0] and WINDOW_S[1] s into
    an open-loop run of ``streams`` (2.5 s)."""
    async def run() -> tuple[dict[str, float], dict[str, tenants.Tally]]:
        load = asyncio.ensure_future(tenants.drive(server.inference, streams, 2.5,
                                                   deadline_s=30.0, drain_s=30.0))
        readings = []
        start = time.monotonic()
        for at in WINDOW_S:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            readings.append(await asyncio.to_thread(tenants.device_seconds, server.metrics))
        tallies = await load
        used = {model: readings[1][model] - readings[0].get(model, 0.0)
                for model in readings[1]}
        total = sum(used.values())
        return {model: seconds / total for model, seconds in used.items()}, tallies

    return asyncio.run(run())


@pytest.mark.parametrize(("weights", "hot_share"), [((1, 1), 0.5), ((3, 1), 0.75)])
def test_saturated_models_get_the_device_time_of_their_weights(
        accelerator: Path, start_server: object, weights: tuple[int, int],
        hot_share: float) -> None:
    server: RunningServer = start_server(job_queue_size=1000)  # type: ignore[operator]
    _register(server, "hot", device_group="sim", device_weight=weights[0])
    _register(server, "cold", device_group="sim", device_weight=weights[1])
    shares, tallies = _shares_while_backlogged(
        server, [tenants.Stream("hot", "hot", RATE), tenants.Stream("cold", "cold", RATE)])
    assert shares["hot"] == pytest.approx(hot_share, abs=0.05), shares
    assert shares["cold"] == pytest.approx(1 - hot_share, abs=0.05), shares
    for tally in tallies.values():  # every request answered, none lost
        assert tally.statuses["200"] == tally.sent, tally.statuses
    device = server.describe("hot")["device"]
    assert device["group"] == "sim" and device["weight"] == weights[0]  # type: ignore[index]
    assert device["deviceTimeS"] > 0  # type: ignore[index,operator]
    data = requests.get(f"{server.management}/dashboard/data", timeout=10).json()
    assert {row["model"] for row in data["devices"]} == {"hot", "cold"}
    assert data["tenants"] == []  # the server tells no tenants apart: no tenant table


def test_a_cold_models_lone_request_is_not_starved_by_a_hot_one(
        accelerator: Path, start_server: object) -> None:
    """While the hot model keeps the device busy (its queue hundreds deep), the cold model's
    requests wait for about one batch of the hot one, not for its queue."""
    server: RunningServer = start_server(job_queue_size=1000)  # type: ignore[operator]
    _register(server, "hot", device_group="sim")
    _register(server, "cold", device_group="sim")

    async def run() -> dict[str, tenants.Tally]:
        return await tenants.drive(server.inference, [tenants.Stream("hot", "hot", 2 * RATE),
                                                      tenants.Stream("cold", "cold", 5.0)],
                                   2.0, deadline_s=30.0, drain_s=30.0, poisson=False)

    tallies = asyncio.run(run())
    cold, hot = tallies["cold"], tallies["hot"]
    assert cold.statuses["200"] == cold.sent == 10
    # The hot model's queue grows to seconds; a cold request waits for a batch or two of it
    # (the worst one a few more: the load generator shares the server's process).
    hot_p50 = tenants.percentile(hot.ok_ms, 50)
    assert hot_p50 > 500
    assert tenants.percentile(cold.ok_ms, 50) < hot_p50 / 4, (cold.ok_ms, hot_p50)
    assert max(cold.ok_ms) < hot_p50 / 2, (cold.ok_ms, hot_p50)


def test_without_a_device_group_nothing_is_shared(accelerator: Path, start_server: object
                                                  ) -> None:
    server: RunningServer = start_server()  # type: ignore[operator]
    _register(server, "solo")
    assert server.predict("solo", b"x").status_code == 200
    assert "device" not in server.describe("solo")
    page = requests.get(f"{server.metrics}/metrics", timeout=10).text
    assert 'batchserve_device_time_seconds_total{' not in page
    # No tenants told apart: no per-tenant device time (nothing kept per batch for it).
    assert 'batchserve_tenant_device_time_seconds_total{' not in page
    answer = requests.post(f"{server.management}/models", params={
        "url": "hot.mar", "device_weight": "0"}, timeout=60)
    assert answer.status_code == 400 and "device_weight" in answer.text
