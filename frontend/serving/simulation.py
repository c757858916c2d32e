"""Simulated time, and workloads replayed through the real Batcher and Dispatcher in it.

``SimulatedTime`` is a clock and a ``call_later`` timer that move only when told. The Batcher and
the Dispatcher take both (their ``clock`` and ``call_later`` arguments), so tests drive them
without sleeping, and ``simulate`` runs minutes of traffic in milliseconds through the same
dispatch rule the server uses: there is no second copy of it here. A simulated worker does no
I/O; it answers each batch ``service_s(rows)`` after it could start it, ``rows`` its items
padded to the workers' batch buckets when they have some (frontend/serving/buckets.py).
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import math
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from frontend.serving.batching import Batcher, Job
from frontend.serving.buckets import normalise, padded_rows
from frontend.serving.dispatch import Dispatcher
from frontend.serving.policies import BatchPolicy
from protos import worker_pb2
from protos.framing import Frame, Kind


class SimulatedTimer:
    """A callback ``SimulatedTime`` runs when its clock reaches ``at``."""

    __slots__ = ("at", "callback", "cancelled")

    def __init__(self, at: float, callback: Callable[[], None]) -> None:
        self.at = at
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class SimulatedTime:
    """A clock that moves only when told, and timers that fire, in order, as it passes them.

    Call the instance for the time (a ``clock``); ``call_later`` and ``call_at`` set timers.
    ``advance`` and ``run_until`` move the clock, running each timer due on the way with the
    clock at that timer's time; ``run`` goes on until no timer is left.
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._timers: list[tuple[float, int, SimulatedTimer]] = []
        self._order = itertools.count()  # timers due at the same time run in the order set

    def __call__(self) -> float:
        return self.now

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> SimulatedTimer:
        at = self.now + max(delay_s, 0.0)
        if delay_s > 0 and at <= self.now:
            # NOTE: a delay below the clock's resolution still fires later than now, as on a
            # real clock, which moves on: a caller that re-arms for what is left of a wait
            # ("D - waited", a few ulps above 0) must not spin at one instant.
            at = math.nextafter(self.now, math.inf)
        return self.call_at(at, callback)

    def call_at(self, at: float, callback: Callable[[], None]) -> SimulatedTimer:
        timer = SimulatedTimer(max(at, self.now), callback)
        heapq.heappush(self._timers, (timer.at, next(self._order), timer))
        return timer

    @property
    def pending(self) -> int:
        """Timers set and not yet run or cancelled."""
        return sum(1 for _, _, timer in self._timers if not timer.cancelled)

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` on, running every timer due by then."""
        self.run_until(self.now + seconds)

    def run_until(self, end: float) -> None:
        while self._timers and self._timers[0][0] <= end:
            self._run_next()
        self.now = max(self.now, end)

    def run(self) -> None:
        """Run timers until none is left (the clock stops at the last one)."""
        while self._timers:
            self._run_next()

    def _run_next(self) -> None:
        at, _, timer = heapq.heappop(self._timers)
        if timer.cancelled:
            return
        timer.cancelled = True  # ran: a later cancel() changes nothing
        self.now = at
        timer.callback()


# -- workloads --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """What ``simulate`` measured: latencies in seconds, throughput in jobs per second."""

    jobs: int
    batches: int
    mean_latency_s: float
    p50_latency_s: float
    p99_latency_s: float
    throughput_per_s: float
    #: Batches per reason they left the queue (``batching.REASONS``).
    reasons: dict[str, int] = field(default_factory=dict)
    #: With batch buckets: the batches that needed no padding, and the rows run (padding
    #: included) and padded.
    bucket_hits: int = 0
    rows: int = 0
    padded_rows: int = 0

    @property
    def mean_batch_size(self) -> float:
        return self.jobs / self.batches if self.batches else 0.0

    @property
    def padding_share(self) -> float:
        """The share of the rows run that were padding (0 without buckets)."""
        return self.padded_rows / self.rows if self.rows else 0.0


def linear_service(overhead_s: float, per_item_s: float) -> Callable[[int], float]:
    """A handler whose batch of n items takes ``overhead_s + per_item_s * n``."""
    return lambda items: overhead_s + per_item_s * items


_PREDICT = Frame(Kind.PREDICT, b"")
_PREDICTED = Frame(Kind.PREDICTED, b"")


class SimulatedWorker:
    """A worker connection (dispatch.Connection) whose handler runs one batch at a time and
    answers it ``service_s(items)`` after it could start it; and its exchange
    (dispatch.Exchange): a reply tells the batcher how long the batch took, then ``answer``
    answers its jobs."""

    def __init__(self, time: SimulatedTime, service_s: Callable[[int], float],
                 batcher: Batcher, answer: Callable[[list[Job]], None],
                 buckets: tuple[int, ...] = ()) -> None:
        self.on_partial: Callable[[worker_pb2.Response], None] | None = None
        self.batches = 0
        #: Its batch buckets (it pads each batch to them), its hits, rows run and padded.
        self.buckets = buckets
        self.hits = self.rows = self.padded = 0
        self._time = time
        self._service_s = service_s
        self._batcher = batcher
        self._answer = answer
        self._free_at = -math.inf
        self._items = 0
        self._replies: list[SimulatedTimer] = []

    def frame(self, jobs: list[Job]) -> Frame:
        # The Dispatcher builds a batch's frame right before it sends it.
        items = sum(job.weight for job in jobs)
        self._items = rows = padded_rows(items, self.buckets)
        self.rows += rows
        self.padded += rows - items
        self.hits += rows == items
        return _PREDICT

    def finish(self, jobs: list[Job], reply: Frame, took_s: float) -> Callable[[], None]:
        self._batcher.completed(sum(job.weight for job in jobs), took_s)
        return lambda: self._answer(jobs)

    @staticmethod
    def lost(jobs: list[Job]) -> None:
        """Never called: a simulated batch is always answered."""

    @staticmethod
    def bound(response: worker_pb2.Response) -> worker_pb2.Response:
        return response

    def send(self, frame: Frame, on_reply: Callable[[Frame | BaseException], None]) -> None:
        self.batches += 1
        self._free_at = max(self._time.now, self._free_at) + self._service_s(self._items)
        self._replies = [timer for timer in self._replies if not timer.cancelled]
        self._replies.append(self._time.call_at(self._free_at, lambda: on_reply(_PREDICTED)))

    def forget_replies(self) -> None:
        for timer in self._replies:
            timer.cancel()
        self._replies.clear()

    def kill(self) -> None:
        self.forget_replies()


def simulate(
    policy: BatchPolicy,
    *,
    max_batch_size: int,
    service_s: Callable[[int], float],
    rate_per_s: float | None = None,
    clients: int | None = None,
    think_s: float = 0.001,
    workers: int = 1,
    batches_in_flight: int = 1,
    duration_s: float = 10.0,
    seed: int = 0,
    buckets: tuple[int, ...] = (),
    policy_knows_buckets: bool = True,
) -> SimulationResult:
    """Replay a workload through a real Batcher driven by ``policy`` and one real Dispatcher per
    simulated worker, in simulated time.

    Load is open (Poisson arrivals at ``rate_per_s``) or closed (``clients`` that each send their
    next request ``think_s`` (0.5-1.5x, uniform) after their answer). Requests are sent for
    ``duration_s``; the run ends when all are answered. ``batches_in_flight`` is the server's
    setting of that name (1: TorchServe's one batch per worker). With ``buckets`` the workers
    pad each batch to them (its service time is that of its rows), and the batcher is told them
    as the server tells it once its workers load, unless ``policy_knows_buckets`` is False (as
    before issue 33). The queue is unbounded and no batch times out.
    """
    _check_load(rate_per_s, clients, max_batch_size, workers, batches_in_flight)
    rng = random.Random(seed)
    time = SimulatedTime()
    reasons: collections.Counter[str] = collections.Counter()
    batcher = Batcher(max_batch_size=max_batch_size, capacity=sys.maxsize, policy=policy,
                      clock=time, call_later=time.call_later,
                      on_formed=lambda batch: reasons.update((batch.reason,)))
    buckets = normalise(buckets)
    if policy_knows_buckets:
        batcher.use_buckets(buckets)
    request, response = worker_pb2.Request(), worker_pb2.Response(status=200)
    latencies: list[float] = []
    ended: list[BaseException | None] = []
    last_answer = 0.0
    # The jobs' futures need a loop; it never runs (the simulated time runs every callback).
    loop = asyncio.new_event_loop()

    def arrive() -> None:
        batcher.submit(Job(request, loop.create_future()))
        if rate_per_s is not None:
            following = time.now + rng.expovariate(rate_per_s)
            if following < duration_s:
                time.call_at(following, arrive)

    def answer(jobs: list[Job]) -> None:
        nonlocal last_answer
        last_answer = time.now
        for job in jobs:
            latencies.append(time.now - job.enqueued_at)
            job.resolve(response)
            if clients is not None:
                following = time.now + think_s * rng.uniform(0.5, 1.5)
                if following < duration_s:
                    time.call_at(following, arrive)

    simulated = [SimulatedWorker(time, service_s, batcher, answer, buckets)
                 for _ in range(workers)]
    try:
        for index, worker in enumerate(simulated):
            Dispatcher(f"W-sim-{index}", batcher, worker, timeout_s=math.inf,
                       max_in_flight=batches_in_flight, exchange=worker, on_done=ended.append,
                       call_later=time.call_later, clock=time).start()
        if rate_per_s is not None:
            time.call_at(rng.expovariate(rate_per_s), arrive)
        else:
            assert clients is not None
            for _ in range(clients):
                time.call_at(think_s * rng.uniform(0.5, 1.5), arrive)
        time.run()
    finally:
        loop.close()
    if ended:
        raise RuntimeError(f"a simulated worker stopped: {ended[0]!r}")
    return _summary(latencies, simulated, last_answer, dict(reasons))


def _check_load(rate_per_s: float | None, clients: int | None, max_batch_size: int,
                workers: int, batches_in_flight: int) -> None:
    if (rate_per_s is None) == (clients is None):
        raise ValueError("give exactly one of rate_per_s (open loop) or clients (closed loop)")
    if max_batch_size < 1 or workers < 1 or batches_in_flight < 1:
        raise ValueError("max_batch_size, workers and batches_in_flight must be >= 1")
    if rate_per_s is not None and rate_per_s <= 0:
        raise ValueError("rate_per_s must be > 0")


def _summary(latencies: list[float], simulated: list[SimulatedWorker], last_answer_s: float,
             reasons: dict[str, int]) -> SimulationResult:
    batches = sum(worker.batches for worker in simulated)
    if not latencies:
        return SimulationResult(0, 0, 0.0, 0.0, 0.0, 0.0, reasons)
    ordered = sorted(latencies)
    return SimulationResult(
        jobs=len(ordered),
        batches=batches,
        mean_latency_s=statistics.fmean(ordered),
        p50_latency_s=ordered[len(ordered) // 2],
        p99_latency_s=ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        throughput_per_s=len(ordered) / last_answer_s,
        reasons=reasons,
        bucket_hits=sum(worker.hits for worker in simulated) if simulated[0].buckets else 0,
        rows=sum(worker.rows for worker in simulated),
        padded_rows=sum(worker.padded for worker in simulated),
    )
