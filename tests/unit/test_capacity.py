"""The worker caps (frontend/serving/capacity.py): their defaults from the host's limits,
config.properties' keys, and what each admits."""

from __future__ import annotations

import re
import resource
from pathlib import Path

import pytest

from frontend.config import ServerConfig, build_config
from frontend.errors import ConfigError, TooManyWorkers
from frontend.serving.capacity import (
    FDS_PER_WORKER,
    MEMORY_PER_WORKER_BYTES,
    WORKERS_PER_CORE,
    HostLimits,
    WorkerCaps,
    worker_caps,
)
from frontend.serving.placement import GpuAssigner, Placement

GIB = 1024**3


@pytest.mark.parametrize(("host", "per_server"), [
    # The open-file limit binds: 1024 / 2 / 4 = 128.
    (HostLimits(1024, 64 * GIB, 8, 0), 1024 // 2 // FDS_PER_WORKER),
    # Memory binds: 2 GiB / 256 MiB = 8.
    (HostLimits(1_000_000, 2 * GIB, 8, 0), 2 * GIB // MEMORY_PER_WORKER_BYTES),
    (HostLimits(None, 4 * GIB, 2, 0), 4 * GIB // MEMORY_PER_WORKER_BYTES),
    # Never below one worker.
    (HostLimits(16, 100, 1, 0), 1),
])
def test_the_server_cap_is_what_files_and_memory_allow(host: HostLimits,
                                                       per_server: int) -> None:
    assert host.server_workers() == per_server
    caps = worker_caps(ServerConfig(), host)
    assert caps.per_server == per_server
    assert caps.per_model == min(WORKERS_PER_CORE * host.cores, per_server)
    assert "by default" in caps.basis


def test_the_model_cap_follows_cores_gpus_and_default_workers() -> None:
    roomy = HostLimits(1_000_000, 1024 * GIB, 2, 0)
    assert worker_caps(ServerConfig(), roomy).per_model == 2 * WORKERS_PER_CORE
    assert worker_caps(ServerConfig(), HostLimits(1_000_000, 1024 * GIB, 2, 8)).per_model \
        == 8 * WORKERS_PER_CORE
    # The operator's own default_workers_per_model is never refused by the default cap.
    assert worker_caps(ServerConfig(default_workers_per_model=50), roomy).per_model == 50


def test_configured_caps_win_and_the_model_cap_stays_within_the_server_cap() -> None:
    host = HostLimits(1_000_000, 1024 * GIB, 64, 0)
    caps = worker_caps(ServerConfig(max_workers_per_model=3, max_workers_per_server=5), host)
    assert (caps.per_model, caps.per_server) == (3, 5)
    assert "by default" not in caps.basis
    caps = worker_caps(ServerConfig(max_workers_per_model=9, max_workers_per_server=5), host)
    assert (caps.per_model, caps.per_server) == (5, 5)


def test_the_keys_are_read_from_config_properties() -> None:
    config, unknown = build_config({"max_workers_per_model": "4",
                                    "max_workers_per_server": "12"})
    assert (config.max_workers_per_model, config.max_workers_per_server, unknown) == (4, 12, [])
    assert ServerConfig().max_workers_per_model is None
    for value in ("0", "-1", "many", str(2**31)):
        with pytest.raises(ConfigError, match=re.escape("must be an integer in [1, ")):
            build_config({"max_workers_per_server": value})


def test_host_limits_are_read_from_this_process() -> None:
    host = HostLimits.detect(cores=2, gpus=0)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert host.open_files == (None if soft == resource.RLIM_INFINITY else soft)
    assert host.memory_bytes > MEMORY_PER_WORKER_BYTES
    assert host.server_workers() >= 1


CAPS = WorkerCaps(per_model=4, per_server=6)


@pytest.mark.parametrize(("min_workers", "max_workers", "adding", "running"), [
    (4, 4, 4, 2),    # up to the model cap, the server's total exactly at its cap
    (0, 4, 0, 6),    # no worker to start: the server's total does not matter
    (1, 1, -3, 9),   # scaling down is always let through
])
def test_admitted(min_workers: int, max_workers: int, adding: int, running: int) -> None:
    CAPS.admit("m", min_workers, max_workers, adding, running)


@pytest.mark.parametrize(("min_workers", "max_workers", "adding", "running", "named"), [
    (5, 5, 5, 0, "max_workers_per_model"),
    (1, 100_000, 1, 0, "max_workers_per_model"),      # maxWorkers counts too
    (100_000, 100_000, 100_000, 0, "max_workers_per_model"),
    (3, 3, 3, 4, "max_workers_per_server"),
    (2, 4, 1, 6, "max_workers_per_server"),
])
def test_refused_naming_the_cap(min_workers: int, max_workers: int, adding: int, running: int,
                                named: str) -> None:
    with pytest.raises(TooManyWorkers, match=named) as refused:
        CAPS.admit("m", min_workers, max_workers, adding, running)
    assert refused.value.http_status == 400


def test_placement_counts_every_model_s_workers() -> None:
    running = [5]
    placement = Placement(GpuAssigner(0), None, lambda: running[0], cores=1, caps=CAPS)
    placement.admit("m", 2, 2, running=1)  # 5 - 1 + 2 = 6: at the cap
    with pytest.raises(TooManyWorkers, match="would make 7 on this server"):
        placement.admit("m", 3, 3, running=1)
    Placement(GpuAssigner(0), None, lambda: 10**6, cores=1).admit("m", 10**6, 10**6, 0)


def test_the_keys_are_documented() -> None:
    root = Path(__file__).resolve().parent.parent.parent
    for doc in ("README.md", "docs/workers.md"):
        text = (root / doc).read_text()
        assert "max_workers_per_model" in text and "max_workers_per_server" in text, doc
