"""Replicas behind a round-robin balancer under a load ramp, scaled by an autoscaler rule.

    .venv/bin/python -m benchmarks.k8s_scaling                 # the table
    .venv/bin/python -m benchmarks.k8s_scaling --timeline      # plus a row per minute
    .venv/bin/python -m benchmarks.k8s_scaling --plot out.png  # and replicas, p99 over time
    .venv/bin/python -m benchmarks.k8s_scaling --container-concurrency 1 4 8 16

What each scaling rule of docs/kubernetes.md does to latency, to refusals and to the replica
count while the offered load rises, holds and falls again. Nothing runs but this process: time
is simulated, and a run takes seconds.

Each replica is the server's own batching: a real ``Batcher`` with the real policy and one real
``Dispatcher`` per worker (frontend/serving), in simulated time (``SimulatedTime`` and
``SimulatedWorker`` of frontend/serving/simulation.py; a worker answers a batch of n items
``a + b*n`` seconds after it could start it). So the queue depth the autoscaler reads is
``Batcher.depth``, the number ``batchserve_queue_depth`` exports, under the policy's real
batching, and a full queue refuses (503) as the server does at ``job_queue_size``. The rest is a
model, stated here so that the numbers can be judged:

- arrivals are Poisson, their rate piecewise linear (base, rise, hold, fall, base);
- the balancer sends each request to the next ready replica in turn: per-request balancing, as
  Knative's activator or a mesh does (a plain Service balances connections, not requests:
  docs/kubernetes.md);
- a new replica takes ``startup_s`` to become ready (scheduling, image, model load); a removed
  one gets no new request and finishes those it holds (a graceful drain);
- the autoscaler is the HPA's algorithm with the ``autoscaling/v2`` defaults (every 15 s; a
  ratio within 10 % of the target changes nothing; up at most to max(2x, +4) per period; down
  to the highest recommendation of the last 300 s), reading the metric at each period.

Rules (``--rules``; each is the metrics its HPA reads, and the HPA takes the largest of their
recommendations):

- ``none``: ``min_replicas``, always;
- ``queue-depth``: a Pods metric, ``batchserve_queue_depth`` per pod against ``batch_size x
  workers x batches_in_flight`` (``--depth-target``);
- ``rps``: a Pods metric, ``rate(ts_inference_requests_total[1m])`` per pod against 70 % of
  what a pod serves in full batches (``--rps-target``);
- ``queue-depth+rps``: both (what docs/kubernetes.md recommends);
- ``in-pod``: the requests a pod holds (queued, or in its workers' batches: the concurrency
  Knative measures) against the queue-depth target;
- ``ts-counter``: TorchServe's kubernetes/autoscale.md, the External metric
  ``ts_queue_latency_microseconds`` (a counter; the HPA sums the pods' series) against a value
  of ``7000000m``;
- ``queue-wait``: a latency rule, the mean queue wait of the last minute's requests
  (``rate(batchserve_queue_wait_seconds_sum[1m]) / rate(..._count[1m])``, what TorchServe users
  compute from the counters) against ``--wait-target-ms``.

By default it compares none, queue-depth, queue-depth+rps, ts-counter and queue-wait, and the
numbers it prints for a seed are the same on every machine. Results: benchmarks/RESULTS.md,
"Scaling on Kubernetes, simulated".
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from frontend.errors import QueueFull
from frontend.serving import simulation
from frontend.serving.batching import Batcher, Job
from frontend.serving.dispatch import Dispatcher
from frontend.serving.policies import make_policy
from frontend.serving.simulation import SimulatedTime, SimulatedWorker, linear_service
from protos import worker_pb2
from protos.framing import Frame

#: Each rule: the metrics its HPA reads (it takes the largest of their recommendations).
RULES: dict[str, tuple[str, ...]] = {
    "none": (),
    "queue-depth": ("queue-depth",),
    "rps": ("rps",),
    "queue-depth+rps": ("queue-depth", "rps"),
    "in-pod": ("in-pod",),
    "ts-counter": ("ts-counter",),
    "queue-wait": ("queue-wait",),
}
#: The rules a plain run compares.
DEFAULT_RULES = ("none", "queue-depth", "queue-depth+rps", "ts-counter", "queue-wait")
#: Pods metrics (a value per pod, AverageValue target); the others are External (one value,
#: Value target).
_PER_POD = ("queue-depth", "in-pod", "rps")
#: TorchServe's kubernetes/autoscale.md HPA: ``targetValue: "7000000m"`` (7000 microseconds).
TS_COUNTER_TARGET_US = 7000.0


@dataclass(frozen=True, slots=True)
class Scenario:
    """The load, one replica, and the autoscaler (times in seconds)."""

    # the offered load: base, then a linear rise to the peak, a hold, a linear fall, base
    base_rps: float = 4.0
    peak_rps: float = 30.0
    rise_at_s: float = 60.0
    rise_s: float = 600.0
    hold_s: float = 300.0
    fall_s: float = 600.0
    duration_s: float = 2100.0
    # one replica (pod): its model's settings and handler cost a + b*n
    batch_size: int = 8
    max_batch_delay_s: float = 0.100
    batch_policy: str = "adaptive"
    workers: int = 1
    batches_in_flight: int = 2
    overhead_s: float = 0.400
    per_item_s: float = 0.050
    job_queue_size: int = 100
    startup_s: float = 60.0
    # the autoscaler: HPA autoscaling/v2 defaults, and the rules' targets
    period_s: float = 15.0
    min_replicas: int = 2
    max_replicas: int = 8
    tolerance: float = 0.1
    scale_down_window_s: float = 300.0
    #: An HPA scaleDown policy ``{type: Pods, value: N, periodSeconds: 60}`` (None: the
    #: default, 100 % every 15 s).
    scale_down_pods_per_min: int | None = None
    rate_window_s: float = 60.0
    #: queue-depth and in-pod: requests per pod (None: batch_size x workers x
    #: batches_in_flight, a full batch for every batch slot of every worker).
    depth_target: float | None = None
    #: rps: requests per second per pod (None: 70 % of what a pod serves in full batches).
    rps_target: float | None = None
    #: queue-wait: the mean seconds in the queue.
    wait_target_s: float = 0.8

    def rate(self, t: float) -> float:
        """Offered requests per second at time ``t``."""
        rise_end = self.rise_at_s + self.rise_s
        hold_end = rise_end + self.hold_s
        span = self.peak_rps - self.base_rps
        if t < self.rise_at_s or t >= self.fall_end_s:
            return self.base_rps
        if t < rise_end:
            return self.base_rps + span * (t - self.rise_at_s) / self.rise_s
        if t < hold_end:
            return self.peak_rps
        return self.peak_rps - span * (t - hold_end) / self.fall_s

    @property
    def fall_end_s(self) -> float:
        return self.rise_at_s + self.rise_s + self.hold_s + self.fall_s

    @property
    def peak_window(self) -> tuple[float, float]:
        """When the offered load is at its peak."""
        start = self.rise_at_s + self.rise_s
        return start, start + self.hold_s

    @property
    def replica_capacity_rps(self) -> float:
        """What one replica serves in full batches."""
        batch_s = self.overhead_s + self.per_item_s * self.batch_size
        return self.workers * self.batch_size / batch_s

    def target(self, metric: str) -> float:
        """A metric's target: per pod for the Pods metrics, in all for the External ones."""
        if metric in ("queue-depth", "in-pod"):
            if self.depth_target is not None:
                return self.depth_target
            return self.batch_size * self.workers * self.batches_in_flight
        if metric == "rps":
            return self.rps_target if self.rps_target is not None \
                else 0.7 * self.replica_capacity_rps
        if metric == "ts-counter":
            return TS_COUNTER_TARGET_US
        return self.wait_target_s


@dataclass(frozen=True, slots=True)
class Counts:
    """A pod's counters when scraped."""

    t: float
    #: ts_inference_requests_total (answered and refused alike, as the server counts it).
    requests: int
    #: batchserve_queue_wait_seconds' _count and ts_queue_latency_microseconds.
    dispatched: int
    queue_us: float


@dataclass(slots=True)
class Replica:
    """One pod: a Batcher, its Dispatchers, and the counters its metrics page would show."""

    name: str
    batcher: Batcher
    ready_at: float
    #: Items sent to the workers and not yet answered.
    in_flight: int = 0
    requests: int = 0
    dispatched: int = 0
    queue_us: float = 0.0
    removed: bool = False
    #: Its counters at each autoscaler period since it is ready (rates over a window).
    scrapes: list[Counts] = field(default_factory=list)

    def scrape(self, now: float, window_s: float) -> None:
        self.scrapes.append(Counts(now, self.requests, self.dispatched, self.queue_us))
        while self.scrapes[0].t < now - window_s:
            self.scrapes.pop(0)

    def rps(self) -> float | None:
        """rate(ts_inference_requests_total[window]); None before two scrapes."""
        first, last = self.scrapes[0], self.scrapes[-1]
        if last.t <= first.t:
            return None
        return (last.requests - first.requests) / (last.t - first.t)


@dataclass(frozen=True, slots=True)
class Sample:
    """The replica count the autoscaler set at one period."""

    t: float
    replicas: int


@dataclass(slots=True)
class Outcome:
    """One rule's run."""

    rule: str
    #: (arrival time, latency) of every answered request, in arrival order.
    answered: list[tuple[float, float]] = field(default_factory=list)
    #: Arrival times of the requests refused with 503 (the queue they were sent to was full).
    refused: list[float] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    pod_seconds: float = 0.0

    @property
    def offered(self) -> int:
        return len(self.answered) + len(self.refused)

    def latency_quantile(self, q: float, start: float = -math.inf,
                         end: float = math.inf) -> float:
        """The q-quantile latency of the requests that arrived in [start, end) and were
        answered (nan when none was)."""
        values = sorted(latency for arrived, latency in self.answered if start <= arrived < end)
        if not values:
            return math.nan
        return values[min(len(values) - 1, int(len(values) * q))]

    def refused_share(self) -> float:
        return len(self.refused) / max(1, self.offered)

    def replicas_at(self, t: float) -> int:
        """The replica count the autoscaler had set at time ``t``."""
        times = [sample.t for sample in self.samples]
        return self.samples[max(0, bisect.bisect_right(times, t) - 1)].replicas

    def fewest_replicas(self, start: float, end: float) -> int:
        """The lowest replica count set in [start, end)."""
        return min([self.replicas_at(start)]
                   + [sample.replicas for sample in self.samples if start <= sample.t < end])

    @property
    def max_replicas(self) -> int:
        return max(sample.replicas for sample in self.samples)

    @property
    def final_replicas(self) -> int:
        return self.samples[-1].replicas

    def scaled_down(self) -> bool:
        return any(b.replicas < a.replicas for a, b in itertools.pairwise(self.samples))

    def reversals(self) -> int:
        """Scale-ups that came after a scale-down: a rule that follows a rise and a fall has
        none; one that takes away pods the load still needs has to put them back."""
        count, down = 0, False
        for a, b in itertools.pairwise(self.samples):
            if b.replicas < a.replicas:
                down = True
            elif b.replicas > a.replicas and down:
                count += 1
                down = False
        return count


_REQUEST = worker_pb2.Request()
_RESPONSE = worker_pb2.Response(status=200)



class _PodWorker(SimulatedWorker):
    """A simulated worker of one pod: it keeps the pod's counts of what is in flight, what
    was dispatched and how long it queued."""

    def __init__(self, time: SimulatedTime, service: Callable[[int], float], replica: Replica,
                 answer: Callable[[list[Job]], None]) -> None:
        super().__init__(time, service, replica.batcher, answer)
        self._replica = replica

    def frame(self, jobs: list[Job]) -> Frame:
        self._replica.in_flight += sum(job.weight for job in jobs)
        return super().frame(jobs)

    def finish(self, jobs: list[Job], reply: Frame, took_s: float) -> Callable[[], None]:
        self._replica.in_flight -= sum(job.weight for job in jobs)
        self._replica.dispatched += len(jobs)
        self._replica.queue_us += sum(job.queue_wait_s for job in jobs) * 1e6
        return super().finish(jobs, reply, took_s)

class Cluster:
    """Replicas, a round-robin balancer and one autoscaling rule, in simulated time."""

    def __init__(self, scenario: Scenario, rule: str, seed: int) -> None:
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}; choose from {', '.join(RULES)}")
        if not 1 <= scenario.min_replicas <= scenario.max_replicas:
            raise ValueError("need 1 <= min_replicas <= max_replicas")
        self.s = scenario
        self.metrics = RULES[rule]
        self.time = SimulatedTime()
        self.rng = random.Random(seed)
        self.outcome = Outcome(rule)
        self.replicas: list[Replica] = []  # the Deployment's pods (not those removed)
        self.routable: list[Replica] = []  # ready and not removed: the Service's endpoints
        self._turn = 0
        self._recommendations: list[tuple[float, int]] = []
        self._removals: list[float] = []  # when each pod was scaled in
        self._counted_at = 0.0
        self._serial = 0
        self._stopped: list[BaseException | None] = []
        self._service = linear_service(scenario.overhead_s, scenario.per_item_s)
        # The jobs' futures need a loop; it never runs (the simulated time runs every callback).
        self._loop = asyncio.new_event_loop()

    # -- replicas -------------------------------------------------------------------------

    def _add_replica(self, ready_in_s: float) -> None:
        s, time = self.s, self.time
        self._serial += 1
        batcher = Batcher(max_batch_size=s.batch_size, capacity=s.job_queue_size,
                          policy=make_policy(s.batch_policy, s.batch_size, s.max_batch_delay_s),
                          clock=time, call_later=time.call_later)
        replica = Replica(f"pod-{self._serial}", batcher, time.now + ready_in_s)
        for index in range(s.workers):
            worker = _PodWorker(time, self._service, replica, self._answer)
            Dispatcher(f"{replica.name}-W{index}", batcher, worker, timeout_s=math.inf,
                       max_in_flight=s.batches_in_flight, exchange=worker,
                       on_done=self._stopped.append, call_later=time.call_later,
                       clock=time).start()
        self.replicas.append(replica)
        time.call_at(replica.ready_at, lambda: self._ready(replica))

    def _ready(self, replica: Replica) -> None:
        if not replica.removed:
            self.routable.append(replica)

    def _remove_replica(self) -> None:
        """Scale in by one, as a ReplicaSet picks: a pod not ready yet first, else the newest;
        it stops getting requests and finishes what it holds."""
        starting = [r for r in self.replicas if r.ready_at > self.time.now]
        replica = (starting or self.replicas)[-1]
        replica.removed = True
        self.replicas.remove(replica)
        if replica in self.routable:
            self.routable.remove(replica)

    def _count_pods(self) -> None:
        now = self.time.now
        self.outcome.pod_seconds += len(self.replicas) * (now - self._counted_at)
        self._counted_at = now

    # -- requests -------------------------------------------------------------------------

    def _arrive(self) -> None:
        now = self.time.now
        replica = self.routable[self._turn % len(self.routable)]
        self._turn += 1
        replica.requests += 1
        try:
            replica.batcher.submit(Job(_REQUEST, self._loop.create_future()))
        except QueueFull:
            self.outcome.refused.append(now)
        self._next_arrival(now)

    def _next_arrival(self, now: float) -> None:
        # Thinning: candidates at the highest rate, each kept with probability rate(t)/that.
        ceiling = max(self.s.peak_rps, self.s.base_rps)
        t = now
        while True:
            t += self.rng.expovariate(ceiling)
            if t >= self.s.duration_s:
                return
            if self.rng.random() * ceiling < self.s.rate(t):
                self.time.call_at(t, self._arrive)
                return

    def _answer(self, jobs: list[Job]) -> None:
        now = self.time.now
        for job in jobs:
            self.outcome.answered.append((job.enqueued_at, now - job.enqueued_at))
            job.resolve(_RESPONSE)

    # -- the autoscaler -------------------------------------------------------------------

    def _pod_value(self, metric: str, replica: Replica) -> float | None:
        if metric == "queue-depth":
            return replica.batcher.depth
        if metric == "in-pod":
            return replica.batcher.depth + replica.in_flight
        return replica.rps()

    def _external_value(self, metric: str) -> float:
        if metric == "ts-counter":
            # The adapter returns a series per pod; the HPA sums an External metric's values.
            return sum(r.queue_us for r in self.replicas)
        # rate(queue wait _sum) / rate(_count): the mean wait of the last window's requests.
        waited = sum(r.scrapes[-1].queue_us - r.scrapes[0].queue_us for r in self.routable)
        count = sum(r.scrapes[-1].dispatched - r.scrapes[0].dispatched for r in self.routable)
        return waited / count / 1e6 if count else 0.0

    def _recommend(self, metric: str) -> int:
        """The HPA's replica count for one metric (the algorithm of the HPA docs: a ratio to
        the target, a tolerance, and pods not ready or without a value yet counted so as to
        damp the change)."""
        s, current, ready = self.s, len(self.replicas), self.routable
        target = s.target(metric)
        if metric not in _PER_POD:
            ratio = self._external_value(metric) / target
            return current if abs(ratio - 1) <= s.tolerance else math.ceil(ratio * len(ready))
        values = [self._pod_value(metric, r) for r in ready]
        known = [v for v in values if v is not None]
        if not known:
            return current
        total, counted = sum(known), len(known)
        ratio = total / counted / target
        if abs(ratio - 1) <= s.tolerance:
            return current
        up = ratio > 1
        missing, starting = len(values) - counted, current - len(ready)
        if up and (missing or starting):
            counted += missing + starting  # they count as 0 on the way up
        elif not up and missing:
            counted += missing  # and as exactly the target on the way down
            total += missing * target
        ratio = total / counted / target
        if abs(ratio - 1) <= s.tolerance or (ratio > 1) != up:
            return current  # within the tolerance now, or the direction reversed
        return math.ceil(ratio * counted)

    def _scale(self) -> None:
        s, now = self.s, self.time.now
        for replica in self.routable:
            replica.scrape(now, s.rate_window_s)
        current = len(self.replicas)
        desired = current
        if self.metrics:
            recommendation = max(self._recommend(metric) for metric in self.metrics)
            self._recommendations.append((now, recommendation))
            while self._recommendations[0][0] <= now - s.scale_down_window_s:
                self._recommendations.pop(0)
            # Scale-up stabilization 0 s: the latest; scale-down: the highest in the window.
            highest = max(count for _, count in self._recommendations)
            desired = recommendation if recommendation > current else min(highest, current)
            desired = min(desired, max(2 * current, current + 4))
            if s.scale_down_pods_per_min is not None:
                recent = sum(1 for t in self._removals if t > now - 60.0)
                desired = max(desired, current - max(0, s.scale_down_pods_per_min - recent))
            desired = max(s.min_replicas, min(s.max_replicas, desired))
        self._count_pods()
        for _ in range(desired - current):
            self._add_replica(s.startup_s)
        for _ in range(current - desired):
            self._remove_replica()
            self._removals.append(now)
        self.outcome.samples.append(Sample(now, len(self.replicas)))
        if now + s.period_s < s.duration_s:
            self.time.call_at(now + s.period_s, self._scale)

    # -- a run ----------------------------------------------------------------------------

    def run(self) -> Outcome:
        try:
            for _ in range(self.s.min_replicas):
                self._add_replica(0.0)
            self.time.run_until(0.0)  # they are ready at once
            self.time.call_at(0.0, self._scale)
            self._next_arrival(0.0)
            self.time.run()
        finally:
            self._loop.close()
        self._count_pods()
        if self._stopped:
            raise RuntimeError(f"a simulated worker stopped: {self._stopped[0]!r}")
        return self.outcome


def simulate(scenario: Scenario, rule: str, seed: int = 1) -> Outcome:
    """Run ``scenario`` under ``rule``: the same seed gives the same run."""
    return Cluster(scenario, rule, seed).run()


# -- reports ----------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:,.0f}"


def summary(scenario: Scenario, outcomes: list[Outcome]) -> str:
    """One markdown row per rule."""
    peak = scenario.peak_window
    lines = ["| rule | p50 ms | p99 ms | p99 ms at the peak | 503 % | replicas: most | "
             "down, then up again | replicas at the end | pod-minutes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for outcome in outcomes:
        lines.append(
            f"| {outcome.rule} | {_ms(outcome.latency_quantile(0.5))} | "
            f"{_ms(outcome.latency_quantile(0.99))} | "
            f"{_ms(outcome.latency_quantile(0.99, *peak))} | "
            f"{100 * outcome.refused_share():.1f} | {outcome.max_replicas} | "
            f"{outcome.reversals()} | {outcome.final_replicas} | "
            f"{outcome.pod_seconds / 60:,.0f} |")
    return "\n".join(lines)


def timeline(scenario: Scenario, outcomes: list[Outcome], step_s: float = 60.0) -> str:
    """Per ``step_s``: the offered rate, then each rule's replicas at the step's start (and
    the fewest in the step, when fewer) and the p99 of the requests that arrived in it."""
    head = "| t s | offered req/s | " + " | ".join(
        f"{o.rule}: replicas, p99 ms" for o in outcomes) + " |"
    lines = [head, "|" + "---|" * (2 + len(outcomes))]
    t = 0.0
    while t < scenario.duration_s:
        cells = [f"{t:.0f}", f"{scenario.rate(t):.0f}"]
        for o in outcomes:
            first, fewest = o.replicas_at(t), o.fewest_replicas(t, t + step_s)
            count = f"{first}" if fewest == first else f"{first} (down to {fewest})"
            cells.append(f"{count}, {_ms(o.latency_quantile(0.99, t, t + step_s))}")
        lines.append("| " + " | ".join(cells) + " |")
        t += step_s
    return "\n".join(lines)


def describe(scenario: Scenario, seed: int) -> str:
    s = scenario
    limit = "" if s.scale_down_pods_per_min is None \
        else f", at most {s.scale_down_pods_per_min} pod(s) removed a minute"
    return (
        f"One replica: batch_size {s.batch_size}, max_batch_delay "
        f"{s.max_batch_delay_s * 1000:.0f} ms, {s.batch_policy}, {s.workers} worker(s), "
        f"batches_in_flight {s.batches_in_flight}; a batch of n takes "
        f"{s.overhead_s * 1000:.0f} + {s.per_item_s * 1000:.0f}*n ms (full batches: "
        f"{s.replica_capacity_rps:.0f} req/s a pod); job_queue_size {s.job_queue_size}; ready "
        f"{s.startup_s:.0f} s after it is created. Load {s.base_rps:g} req/s; from "
        f"{s.rise_at_s:.0f} s it rises to {s.peak_rps:g} req/s over {s.rise_s:.0f} s, holds "
        f"{s.hold_s:.0f} s, falls back over {s.fall_s:.0f} s; {s.duration_s:.0f} s in all; "
        f"seed {seed}. HPA every {s.period_s:.0f} s, replicas {s.min_replicas}-{s.max_replicas}, "
        f"scale-down window {s.scale_down_window_s:.0f} s{limit}. Targets: queue-depth "
        f"{s.target('queue-depth'):g} a pod, rps {s.target('rps'):g} a pod (over "
        f"{s.rate_window_s:.0f} s), ts-counter {TS_COUNTER_TARGET_US:g} us, queue-wait "
        f"{s.wait_target_s * 1000:g} ms.")


def capped_pod(scenario: Scenario, limit: int, policy: str, seed: int,
               duration_s: float = 300.0) -> simulation.SimulationResult:
    """One pod whose requests are capped at ``limit`` (Knative's containerConcurrency) while
    more wait outside it (in the queue-proxy): as many closed-loop clients as the cap, each
    sending its next request as soon as it is answered, through the real Batcher and
    Dispatcher (frontend/serving/simulation.simulate). Latencies count from entering the pod."""
    s = scenario
    return simulation.simulate(
        make_policy(policy, s.batch_size, s.max_batch_delay_s), max_batch_size=s.batch_size,
        service_s=linear_service(s.overhead_s, s.per_item_s), clients=limit, think_s=0.001,
        workers=s.workers, batches_in_flight=s.batches_in_flight, duration_s=duration_s,
        seed=seed)


def concurrency_table(scenario: Scenario, limits: list[int], seed: int) -> str:
    lines = ["| containerConcurrency | batch_policy | req/s a pod | mean batch | "
             "p50 ms in the pod |", "|---|---|---|---|---|"]
    for limit in limits:
        for policy in ("adaptive", "fixed"):
            result = capped_pod(scenario, limit, policy, seed)
            lines.append(f"| {limit} | {policy} | {result.throughput_per_s:.1f} | "
                         f"{result.mean_batch_size:.1f} | {_ms(result.p50_latency_s)} |")
    return "\n".join(lines)


def plot(scenario: Scenario, outcomes: list[Outcome], path: Path, step_s: float = 30.0) -> bool:
    """Replicas and per-step p99 over time, one line per rule; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (load, count, p99) = plt.subplots(3, 1, sharex=True, figsize=(9, 9))
    steps = [i * step_s for i in range(int(scenario.duration_s / step_s))]
    load.plot(steps, [scenario.rate(t) for t in steps], color="black")
    load.set_ylabel("offered req/s")
    for outcome in outcomes:
        count.step([s.t for s in outcome.samples], [s.replicas for s in outcome.samples],
                   where="post", label=outcome.rule)
        p99.plot(steps, [outcome.latency_quantile(0.99, t, t + step_s) * 1000 for t in steps],
                 label=outcome.rule)
    count.set_ylabel("replicas")
    count.legend(loc="upper right", fontsize="small")
    p99.set_ylabel(f"p99 ms (per {step_s:.0f} s)")
    p99.set_yscale("log")
    p99.set_xlabel("simulated seconds")
    figure.suptitle("k8s_scaling: replicas and p99 under a load ramp")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main(argv: list[str] | None = None) -> None:
    defaults = Scenario()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rules", nargs="+", choices=list(RULES), default=list(DEFAULT_RULES))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--peak", type=float, default=defaults.peak_rps,
                        help="peak offered req/s")
    parser.add_argument("--ramp", type=float, default=defaults.rise_s,
                        help="seconds the rise takes, and the fall")
    parser.add_argument("--hold", type=float, default=defaults.hold_s,
                        help="seconds the peak lasts")
    parser.add_argument("--startup", type=float, default=defaults.startup_s,
                        help="seconds from a new pod to its readiness")
    parser.add_argument("--depth-target", type=float, default=None,
                        help="queue-depth/in-pod target a pod (default: batch_size x workers x "
                             "batches_in_flight)")
    parser.add_argument("--rps-target", type=float, default=None,
                        help="rps target a pod (default: 70%% of a pod's full-batch rate)")
    parser.add_argument("--wait-target-ms", type=float, default=defaults.wait_target_s * 1000,
                        help="queue-wait target")
    parser.add_argument("--scale-down-pods-per-min", type=int, default=None,
                        help="an HPA scaleDown policy: at most N pods removed a minute")
    parser.add_argument("--timeline", action="store_true", help="also a row per minute")
    parser.add_argument("--container-concurrency", type=int, nargs="+", default=None,
                        metavar="N", help="instead: one pod's throughput with its requests "
                                          "capped at each N (Knative's containerConcurrency)")
    parser.add_argument("--plot", type=Path, default=None,
                        help="write a PNG of replicas and p99 over time (needs matplotlib)")
    args = parser.parse_args(argv)
    tail_s = defaults.duration_s - defaults.fall_end_s  # the base load after the fall
    scenario = replace(defaults, peak_rps=args.peak, startup_s=args.startup,
                       rise_s=args.ramp, fall_s=args.ramp, hold_s=args.hold,
                       duration_s=defaults.rise_at_s + 2 * args.ramp + args.hold + tail_s,
                       depth_target=args.depth_target, rps_target=args.rps_target,
                       wait_target_s=args.wait_target_ms / 1000,
                       scale_down_pods_per_min=args.scale_down_pods_per_min)
    if args.container_concurrency:
        print(concurrency_table(scenario, args.container_concurrency, args.seed))
        return
    outcomes = [simulate(scenario, rule, args.seed) for rule in args.rules]
    print(describe(scenario, args.seed) + "\n")
    print(summary(scenario, outcomes))
    if args.timeline:
        print()
        print(timeline(scenario, outcomes))
    if args.plot is not None:
        if plot(scenario, outcomes, args.plot):
            print(f"\nplot: {args.plot}")
        else:
            print("\nno plot: matplotlib is not installed")


if __name__ == "__main__":
    main()
