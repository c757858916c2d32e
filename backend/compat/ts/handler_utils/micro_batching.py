"""``ts.handler_utils.micro_batching``: one batch split into micro-batches whose preprocess,
inference and postprocess overlap.

A handler sets ``self.handle = MicroBatching(self)``; each of its three steps gets its own
threads (``parallelism``, one each by default) joined by queues, so that while one
micro-batch is in ``inference`` the next is already in ``preprocess`` and the one before in
``postprocess``. The results come back in the batch's order.

Where TorchServe's differs: a step that raises fails the batch with that exception (the
micro-batches already in flight finish first) instead of losing its thread and hanging the
batch; threads wait on their queue instead of polling it, so ``shutdown`` and a smaller
``parallelism`` take effect at once; and the threads are daemons, so a worker can always exit.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from copy import copy
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: The steps, in order; each one's output queue is the next one's input queue.
HANDLER_METHODS = ["preprocess", "inference", "postprocess"]

#: TorchServe's flag; torch.profiler is part of every torch this runs with.
PROFILER_AVAILABLE = True


class _Failed:
    """What travels down the queues in place of a micro-batch whose step raised."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _StepQueue(queue.Queue[Any]):
    """A queue whose readers also wake up when told to stop."""

    def get_unless(self, stop: threading.Event) -> Any:
        """The next item, or ``_STOPPED`` once ``stop`` is set (checked before every wait)."""
        with self.not_empty:
            while not self._qsize():
                if stop.is_set():
                    return _STOPPED
                self.not_empty.wait()
            item = self._get()
            self.not_full.notify()
            return item

    def wake_all(self) -> None:
        with self.not_empty:
            self.not_empty.notify_all()


_STOPPED = object()


def execute_call(in_queue: Any, out_queue: Any, handle: Callable[[Any], Any],
                 thread_local_data: threading.local, event: threading.Event) -> None:
    """One step's thread: take ``(index, micro-batch)``, run ``handle`` on it, pass
    ``(index, result)`` on, until ``event`` is set. A failure travels on in place of the
    result; later steps pass it through."""
    while not event.is_set():
        if isinstance(in_queue, _StepQueue):
            item = in_queue.get_unless(event)
            if item is _STOPPED:
                return
        else:
            try:
                item = in_queue.get(timeout=0.5)
            except queue.Empty:
                continue
        idx, data = item
        thread_local_data.micro_batch_idx = idx
        if not isinstance(data, _Failed):
            try:
                data = handle(data)
            except Exception as exc:  # the batch fails with it, the thread lives on
                data = _Failed(exc)
        out_queue.put((idx, data))


@dataclass
class WorkerThread:
    """A step's thread and the event that stops it."""

    event: threading.Event
    thread: threading.Thread


class MicroBatching:
    """Runs ``parent_handler``'s preprocess -> inference -> postprocess on micro-batches of
    ``micro_batch_size`` requests, each step in its own threads (``parallelism``: step ->
    number of threads, 1 where not given)."""

    def __init__(self, parent_handler: Any, micro_batch_size: int = 1,
                 parallelism: dict[str, int] | None = None) -> None:
        self.handler = parent_handler
        self.micro_batch_size = micro_batch_size
        self._parallelism: dict[str, int] = dict(parallelism) if parallelism else {}
        self.thread_groups: dict[str, list[WorkerThread]] = {m: [] for m in HANDLER_METHODS}
        self.queues: dict[str, _StepQueue] = {}
        self.thread_local_data = threading.local()
        self.terminate = threading.Event()
        # handle() runs one batch at a time: its results are the only ones on the last queue.
        self._batch_lock = threading.Lock()
        self._create_queues()
        self._update_threads()

    def __del__(self) -> None:
        self.shutdown()

    @property
    def parallelism(self) -> dict[str, int]:
        """Threads per step (a copy; assign to change it)."""
        return copy(self._parallelism)

    @parallelism.setter
    def parallelism(self, parallelism: dict[str, int]) -> None:
        unknown = set(parallelism) - set(HANDLER_METHODS)
        if unknown:
            raise ValueError(f"parallelism names unknown steps {sorted(unknown)}; the steps "
                             f"are {HANDLER_METHODS}")
        self._parallelism.update(parallelism)
        self._update_threads()

    def shutdown(self) -> None:
        """Stop every thread and wait for them (a micro-batch being processed finishes)."""
        for method in HANDLER_METHODS:
            while getattr(self, "thread_groups", {}).get(method):
                self._stop_one(method)

    def _create_queues(self) -> None:
        self.queues[f"{HANDLER_METHODS[0]}_in"] = _StepQueue()
        for step, following in itertools.pairwise(HANDLER_METHODS):
            joint = _StepQueue()
            self.queues[f"{step}_out"] = joint
            self.queues[f"{following}_in"] = joint
        self.queues[f"{HANDLER_METHODS[-1]}_out"] = _StepQueue()

    def _update_threads(self) -> None:
        for method in HANDLER_METHODS:
            wanted = self._parallelism.get(method, 1)
            if not isinstance(wanted, int) or wanted < 0:
                raise ValueError(f"parallelism of {method} must be a whole number >= 0, "
                                 f"got {wanted!r}")
            group = self.thread_groups[method]
            while len(group) < wanted:
                event = threading.Event()
                thread = threading.Thread(
                    target=execute_call, daemon=True,
                    name=f"micro-batching-{method}-{len(group)}",
                    args=(self.queues[f"{method}_in"], self.queues[f"{method}_out"],
                          getattr(self.handler, method), self.thread_local_data, event))
                thread.start()
                group.append(WorkerThread(event, thread))
            while len(group) > wanted:
                self._stop_one(method)

    def _stop_one(self, method: str) -> None:
        worker = self.thread_groups[method].pop()
        worker.event.set()
        self.queues[f"{method}_in"].wake_all()
        if worker.thread is not threading.current_thread():
            worker.thread.join()

    def handle(self, data: list[Any]) -> list[Any]:
        """``data`` through the three steps in micro-batches; one result per request, in
        order. Raises the first failure of a step (by micro-batch order) once every
        micro-batch is back."""
        size = self.micro_batch_size
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"micro_batch_size must be a whole number >= 1, got {size!r}")
        for method in HANDLER_METHODS:
            if not self.thread_groups[method]:
                raise RuntimeError(f"micro-batching has no thread for {method} "
                                   f"(parallelism {self._parallelism}); the batch would wait "
                                   f"forever")
        with self._batch_lock:
            inbox, outbox = (self.queues[f"{HANDLER_METHODS[0]}_in"],
                             self.queues[f"{HANDLER_METHODS[-1]}_out"])
            count = 0
            for count, start in enumerate(range(0, len(data), size), start=1):
                inbox.put_nowait((count - 1, data[start:start + size]))
            done = sorted((outbox.get() for _ in range(count)), key=lambda item: item[0])
        failures = [result for _, result in done if isinstance(result, _Failed)]
        if failures:
            raise failures[0].error
        return [item for _, results in done for item in results]

    def get_micro_batch_idx(self) -> int | None:
        """In a step's thread: the index of the micro-batch it is processing."""
        return getattr(self.thread_local_data, "micro_batch_idx", None)

    def __call__(self, data: list[Any], context: Any) -> Any:
        """The handler's entry point (``handler.handle = MicroBatching(handler)``): describe
        and explanation requests run the handler's own way, predictions in micro-batches;
        records ``HandlerTime``."""
        start = time.time()
        handler = self.handler
        handler.context = context
        if os.environ.get("ENABLE_TORCH_PROFILER"):
            output, _ = handler._infer_with_profiler(data=data)
        elif handler._is_describe():
            output = [handler.describe_handle()]
        elif handler._is_explain():
            output = handler.explain_handle(handler.preprocess(data), data)
        else:
            output = self.handle(data)
        context.metrics.add_time("HandlerTime", round((time.time() - start) * 1000, 2), None,
                                 "ms")
        return output
