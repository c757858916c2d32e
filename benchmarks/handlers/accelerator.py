"""A stand-in accelerator: a batch of n requests costs a + b*n milliseconds of sleep.

This is what batching on a GPU looks like (a fixed cost per launch, a small cost per item),
reproducible on a CPU and with no CPU use, so that the server's batching decisions are the only
thing measured. Each request is answered with its own body, plus an ``X-Batch-Size`` response
header that tells the client the size of the batch it was served in (the load generator reads
it, so that batch sizes are known for servers that do not export them, e.g. TorchServe).

A module-level ``handle`` that works unchanged in batchserve and in TorchServe 0.12 (both call
``handle(None, context)`` once when the model loads). The costs are module constants read once
at import in the worker, from the environment the server was started with:

* ``BENCH_ACCEL_OVERHEAD_MS`` (a, default 20)
* ``BENCH_ACCEL_PER_ITEM_MS`` (b, default 1)
* ``BENCH_ACCEL_DEVICE`` (default unset): a lock file; every worker that names the same file
  shares one device that runs one batch at a time (each batch holds an exclusive ``flock`` on
  it while it sleeps), as one GPU shared by several models (benchmarks/tenants.py)
"""

from __future__ import annotations

import fcntl
import os
import time
from typing import Any

OVERHEAD_MS = float(os.environ.get("BENCH_ACCEL_OVERHEAD_MS", "20"))
PER_ITEM_MS = float(os.environ.get("BENCH_ACCEL_PER_ITEM_MS", "1"))
DEVICE = os.environ.get("BENCH_ACCEL_DEVICE", "")


def batch_cost_s(size: int) -> float:
    """Seconds a batch of ``size`` requests sleeps."""
    return (OVERHEAD_MS + PER_ITEM_MS * size) / 1000.0


def handle(data: list[dict[str, Any]] | None, context: Any) -> list[Any] | None:
    if data is None:  # the load-time call: nothing to initialise
        return None
    if DEVICE:
        with open(DEVICE, "a") as device:
            fcntl.flock(device, fcntl.LOCK_EX)  # the device runs one batch at a time
            time.sleep(batch_cost_s(len(data)))
    else:
        time.sleep(batch_cost_s(len(data)))
    size = str(len(data))
    for index in range(len(data)):
        context.set_response_header(index, "X-Batch-Size", size)
    return [row.get("body", row.get("data", b"")) for row in data]
