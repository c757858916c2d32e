"""``ts.handler_utils.micro_batching.MicroBatching``: a batch split into micro-batches whose
preprocess, inference and postprocess run at the same time in their own threads.

In-process, with small handlers written here (the server-side test with TorchServe's
archiver is tests/compat/test_torchserve_micro_batching.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from backend.context import Context
from tests.unit.test_ts_compat import ts_shim

__all__ = ["ts_shim"]  # the autouse fixture that installs the shim for each test

WAIT_S = 10.0


def micro_batching() -> Any:
    from ts.handler_utils import micro_batching as module  # the shim, installed by ts_shim

    return module


class Recorder:
    """A handler whose steps record which micro-batch each one saw, on which thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, int | None, list[Any], str]] = []
        self.handle: Any = None

    def _record(self, step: str, data: list[Any]) -> None:
        with self.lock:
            self.calls.append((step, self.handle.get_micro_batch_idx(), list(data),
                               threading.current_thread().name))

    def preprocess(self, data: list[Any]) -> list[Any]:
        self._record("preprocess", data)
        return [item * 10 for item in data]

    def inference(self, data: list[Any]) -> list[Any]:
        self._record("inference", data)
        return [item + 1 for item in data]

    def postprocess(self, data: list[Any]) -> list[Any]:
        self._record("postprocess", data)
        return [f"r{item}" for item in data]


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    handler = Recorder()
    handler.handle = micro_batching().MicroBatching(handler, micro_batch_size=3)
    yield handler
    handler.handle.shutdown()


def test_results_come_back_in_order_from_micro_batches_of_the_size_asked(
        recorder: Recorder) -> None:
    assert recorder.handle.handle(list(range(8))) == [f"r{i * 10 + 1}" for i in range(8)]

    preprocessed = sorted((idx, data) for step, idx, data, _ in recorder.calls
                          if step == "preprocess")
    assert preprocessed == [(0, [0, 1, 2]), (1, [3, 4, 5]), (2, [6, 7])]
    steps = {step: {thread for s, _, _, thread in recorder.calls if s == step}
             for step in ("preprocess", "inference", "postprocess")}
    assert all(len(threads) == 1 for threads in steps.values())  # parallelism 1 each
    assert len(set.union(*steps.values())) == 3  # a thread per step
    assert recorder.handle.handle([]) == []


def test_the_steps_of_different_micro_batches_run_at_the_same_time() -> None:
    """Micro-batch k's inference waits until micro-batch k+1's preprocess has started, and
    k+1's preprocess until k's inference has started: run one step after the other, the
    batch would never finish (each wait fails after WAIT_S)."""
    events: dict[tuple[str, int], threading.Event] = {}
    lock = threading.Lock()
    count = 4

    def event(step: str, idx: int) -> threading.Event:
        with lock:
            return events.setdefault((step, idx), threading.Event())

    class Overlapping:
        handle: Any = None

        def preprocess(self, data: list[Any]) -> list[Any]:
            idx = self.handle.get_micro_batch_idx()
            event("preprocess", idx).set()
            if idx > 0:
                assert event("inference", idx - 1).wait(WAIT_S), "not overlapped"
            return data

        def inference(self, data: list[Any]) -> list[Any]:
            idx = self.handle.get_micro_batch_idx()
            event("inference", idx).set()
            if idx < count - 1:
                assert event("preprocess", idx + 1).wait(WAIT_S), "not overlapped"
            return data

        def postprocess(self, data: list[Any]) -> list[Any]:
            return data

    handler = Overlapping()
    handler.handle = micro_batching().MicroBatching(handler, micro_batch_size=2)
    try:
        started = time.monotonic()
        assert handler.handle.handle(list(range(2 * count))) == list(range(2 * count))
        assert time.monotonic() - started < WAIT_S
    finally:
        handler.handle.shutdown()


def test_a_failing_step_fails_the_batch_and_the_threads_live_on(recorder: Recorder) -> None:
    original = recorder.inference

    def inference(data: list[Any]) -> list[Any]:
        if 40 in data:
            raise ValueError("bad row")
        return original(data)

    recorder.handle.parallelism = {"inference": 0}  # rebuild the inference thread...
    recorder.inference = inference  # type: ignore[method-assign]
    recorder.handle.parallelism = {"inference": 1}  # ...so that it calls the failing step

    with pytest.raises(ValueError, match="bad row"):
        recorder.handle.handle(list(range(8)))
    assert recorder.handle.handle([1, 2]) == ["r11", "r21"]


def test_parallelism_sets_threads_per_step_and_shutdown_stops_them(recorder: Recorder) -> None:
    mb = recorder.handle
    mb.parallelism = {"preprocess": 3, "postprocess": 2}
    assert mb.parallelism == {"preprocess": 3, "postprocess": 2}
    assert {step: len(group) for step, group in mb.thread_groups.items()} == {
        "preprocess": 3, "inference": 1, "postprocess": 2}
    assert mb.handle(list(range(9))) == [f"r{i * 10 + 1}" for i in range(9)]
    with pytest.raises(ValueError, match="unknown steps"):
        mb.parallelism = {"decode": 2}
    mb.parallelism = {"inference": 0}
    with pytest.raises(RuntimeError, match="no thread for inference"):
        mb.handle([1])  # instead of waiting forever
    threads = [worker.thread for group in mb.thread_groups.values() for worker in group]

    started = time.monotonic()
    mb.shutdown()

    assert time.monotonic() - started < 2.0  # woken, not polled
    assert not any(thread.is_alive() for thread in threads)
    assert all(not group for group in mb.thread_groups.values())


def test_calling_it_runs_describe_explain_or_micro_batches_and_records_handler_time(
        recorder: Recorder) -> None:
    """``handler.handle = MicroBatching(handler)``: the worker calls it with (data, context)."""
    calls: list[str] = []
    recorder._is_describe = lambda: False  # type: ignore[attr-defined]
    recorder._is_explain = lambda: False  # type: ignore[attr-defined]
    times: list[tuple[Any, ...]] = []

    class Metrics:  # what the call needs of context.metrics
        request_ids: Any = None

        def add_time(self, *args: Any) -> None:
            times.append(args)

    context = Context("m", "/tmp", {}, 4, None, "0", metrics=Metrics())  # type: ignore[arg-type]
    context.begin_batch(["a", "b"], [{}, {}])

    assert recorder.handle([5, 6], context) == ["r51", "r61"]
    assert recorder.context is context  # type: ignore[attr-defined]
    assert [(name, unit) for name, _, _, unit in times] == [("HandlerTime", "ms")]

    recorder._is_explain = lambda: True  # type: ignore[attr-defined]
    recorder.explain_handle = lambda pre, raw: calls.append("explain") or ["e"] * len(raw)  # type: ignore[attr-defined]
    assert recorder.handle([5], context) == ["e"]
    assert calls == ["explain"]
