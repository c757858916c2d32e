"""A worker slot keeps trying whatever stops its process from starting, and says so."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from frontend.ops.management import describe_worker
from frontend.serving.batching import Batcher
from frontend.serving.policies import FixedPolicy
from frontend.serving.workers import (
    UNHEALTHY_AFTER_FAILURES,
    Worker,
    WorkerLaunch,
    WorkerStartError,
)
from protos import worker_pb2


async def _until(predicate: object, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def test_an_os_error_starting_the_process_is_retried_logged_and_reported(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A python that does not exist: create_subprocess_exec raises FileNotFoundError, an
    # OSError like EMFILE or a failed fork. It used to end the supervisor task silently.
    launch = WorkerLaunch(load=worker_pb2.LoadModel(model_name="m", model_version="1.0"),
                          run_dir=tmp_path, startup_timeout_s=5, response_timeout_s=5,
                          python=str(tmp_path / "no-such-python"))
    downs: list[int] = []

    async def scenario() -> None:
        batcher = Batcher(max_batch_size=1, capacity=10, policy=FixedPolicy(1, 0.0))
        worker = Worker(launch, batcher, 9000, None, on_down=lambda: downs.append(worker.failures))
        first = await asyncio.wait_for(worker.first_start, 5)
        assert isinstance(first, WorkerStartError)
        assert "FileNotFoundError" in str(first)
        await _until(lambda: worker.failures >= UNHEALTHY_AFTER_FAILURES, "repeated retries")
        assert worker.is_unhealthy and worker.is_down
        assert worker.restarts >= UNHEALTHY_AFTER_FAILURES - 1
        described = describe_worker(worker)
        assert "FileNotFoundError" in described["lastError"]  # type: ignore[operator]
        assert described["pid"] == -1
        await asyncio.wait_for(worker.stop(5), 10)

    with caplog.at_level(logging.ERROR, logger="frontend.serving.workers"):
        asyncio.run(scenario())
    assert downs[:UNHEALTHY_AFTER_FAILURES] == list(range(1, UNHEALTHY_AFTER_FAILURES + 1))
    assert sum("could not be started" in r.getMessage()
               for r in caplog.records) >= UNHEALTHY_AFTER_FAILURES
    # No socket is left behind by the failed starts.
    assert list(tmp_path.glob("*.sock")) == []
