"""The event path alone, without a profiler: what recording one call's end and one batch's end
costs the frontend, in µs, for the tree on PYTHONPATH: this one (the serving core publishes
facts to its observers, issue 32) or one from before it (the plane and the batcher called
their sinks). Run it once per tree, the same minute:

    PYTHONPATH=/path/to/tree .venv/bin/python benchmarks/event_path.py

* a call's end: ``InferencePlane.end`` of a call a worker answered (TorchServe's request
  counters, our latency histogram and the request's frontend phase, the access-log entry, as
  the defaults keep them), on a running event loop, 200,000 calls;
* a batch of 8's end: what its reply's accounting records, best of 15 runs of 2,000 (before: the
  batch's timing split, the model's recent sizes and totals, the dispatcher's busy time, the
  batch's metrics and phases and WorkerThreadTime; since: the reply's facts noted, then the
  ``ended`` event to the same records, the busy time and WorkerThreadTime included).
"""

from __future__ import annotations

import asyncio
import collections
import tempfile
import time
import timeit
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from frontend.observe.logs import AccessLog
from frontend.observe.metrics import ServerMetrics
from frontend.ops import plane as planes
from frontend.serving import batching
from frontend.serving.policies import FixedPolicy
from protos import worker_pb2

CALLS = 200_000
BEFORE = hasattr(batching, "BatchTiming")  # the tree before issue 32
RESULT = worker_pb2.PredictResult(handler_time_ms=0.5,
                                  responses=[worker_pb2.Response(status=200)] * 8)


def main() -> None:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    access = AccessLog(Path(tempfile.mkdtemp()) / "access_log.log")
    access.open()
    model = SimpleNamespace(name="echo", version="1.0", key=("echo", "1.0"))
    events: Any = None
    if BEFORE:
        metrics: Any = ServerMetrics([], system_metrics=False)  # type: ignore[arg-type]
        plane = planes.InferencePlane(None, metrics, access)  # type: ignore[arg-type]
    else:
        from frontend.observe.dashboard import BusyTime
        from frontend.server import observers

        metrics = ServerMetrics(system_metrics=False)
        subscribed = observers(metrics, access, BusyTime(), None)
        plane = planes.InferencePlane(None, subscribed, access)  # type: ignore[arg-type]
        subscribed.registered("echo", "1.0")
        events = subscribed.of_model("echo", "1.0")

    def batch(size: int) -> list[batching.Job]:
        options = {} if BEFORE else {"on_formed": events.formed}
        batcher = batching.Batcher(max_batch_size=size, capacity=100,
                                   policy=FixedPolicy(size, 0.0), clock=time.monotonic,
                                   **options)
        for _ in range(size):
            batcher.submit(batching.Job(worker_pb2.Request(), loop.create_future()))
        jobs = batcher.take_ready()
        assert jobs is not None
        return jobs

    def answered_call() -> planes.Call:
        [job] = batch(1)
        end_batch([job])
        call = planes.Call(planes.Origin("/127.0.0.1:1", "POST", "/predictions/echo",
                                         "HTTP/1.1"), job)
        call.model = model  # type: ignore[assignment]
        if not BEFORE:
            call.key = model.key
        call.status = 200
        return call

    sizes: collections.deque[int] = collections.deque(maxlen=64)
    totals, busy = [0, 0], [0.0]

    def end_batch(jobs: list[batching.Job]) -> None:
        if BEFORE:
            jobs[0].timing.answer(0.001, 0.5, None)  # type: ignore[attr-defined]
            # Model._record_batch's counters, the dispatcher's busy time.
            sizes.append(len(jobs))
            totals[0] += 1
            totals[1] += len(jobs)
            busy[0] += 0.001
            metrics.record_batch(model, jobs, RESULT)
            metrics.batch_overhead(0.3)
            return
        facts = jobs[0].batch
        assert facts is not None
        facts.ended_at, facts.replied, facts.worker = facts.left_at + 0.001, True, "1"
        facts.service_s, facts.frontend_marks = 0.001, [0.0, 1e-4, 2e-4, 3e-4]
        facts.note_reply(RESULT)
        events.ended(facts, jobs, RESULT)

    calls = iter([answered_call() for _ in range(CALLS)])

    async def ends() -> float:  # on a running loop, as the server's: the log flushes later
        return timeit.timeit(lambda: plane.end(next(calls)), number=CALLS)

    tree = "before" if BEFORE else "this tree"
    print(f"{tree}: a call's end {loop.run_until_complete(ends()) / CALLS * 1e6:.2f} µs")
    eight = batch(8)
    best = min(timeit.repeat(lambda: end_batch(eight), number=2000, repeat=15)) / 2000
    print(f"{tree}: a batch of 8's end {best * 1e6:.2f} µs (best of 15)")
    access.close()


if __name__ == "__main__":
    main()
