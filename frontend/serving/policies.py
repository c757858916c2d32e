"""Batch policies: when a free worker should stop collecting jobs and dispatch its batch.

The Batcher (frontend/serving/batching.py) tells a policy what happened (a job arrived, a
worker answered a batch) and, whenever a worker is free and jobs are queued, asks it how much
longer to wait. A policy never reads a clock and never touches the queue: every hook gets the
Batcher's ``now``, so tests drive it with a fake clock, and frontend/serving/simulation.py
replays whole workloads through the real Batcher in simulated time.

* ``FixedPolicy`` is TorchServe's rule: dispatch when ``max_batch_size`` jobs are queued, else
  ``max_delay_s`` after the worker found the first one.
* ``AdaptivePolicy`` (the default) waits only while the jobs it expects are close enough to pay
  for the wait, and never past ``max_delay_s``. docs/batching.md derives its rule. Told the
  batch sizes the model's workers run without padding (``use_buckets``, issue 33), it prefers
  batches of those sizes where that costs no job any latency, and never waits longer for them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from frontend.serving.buckets import BucketTable
from frontend.settings import PolicyName


class BatchPolicy(Protocol):
    """Decides when the batch a free worker is collecting leaves the queue.

    All hooks run on the Batcher's event loop; ``now`` is the Batcher's monotonic clock, in
    seconds, the same clock for every hook.
    """

    #: The longest a batch waits for company (a dispatch at it is counted as ``max_delay``).
    max_delay_s: float

    def on_arrival(self, now: float) -> None:
        """A job entered the queue (once per job, before the ``wait_s`` that counts it)."""
        ...

    def on_completed(self, size: int, service_s: float, now: float) -> None:
        """A worker answered a batch of ``size`` jobs ``service_s`` seconds after it was sent.

        Called only for batches that came back with results: a crashed worker's timing says
        nothing about the model.
        """
        ...

    def wait_s(self, queued: int, waited_s: float, idle_workers: int, now: float) -> float:
        """Seconds to keep collecting; 0 or less means dispatch now.

        ``queued`` is the number of live jobs in the queue (>= 1), ``waited_s`` how long the
        asking worker has been collecting since it found the first one, ``idle_workers`` the
        number of free workers, the asking one included. The answer is a deadline for asking
        again: the Batcher asks again on every arrival and when the wait runs out. Must not
        change the policy's state.
        """
        ...

    def use_buckets(self, buckets: Sequence[int]) -> None:
        """The model's batch buckets (ascending; empty: its workers run any size as it is):
        a batch of n items runs as ``buckets.padded_rows(n)`` rows."""
        ...

    def batch_items(self, queued: int, idle_workers: int, now: float) -> int:
        """The most items the batch leaving now may take, of ``queued`` (``max_batch_size``:
        as many as fit); ``idle_workers`` and ``now`` as ``wait_s``'s. Must not change the
        policy's state."""
        ...


def _check_limits(max_batch_size: int, max_delay_s: float) -> None:
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) \
            or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
    if not math.isfinite(max_delay_s) or max_delay_s < 0:
        raise ValueError(f"max_delay_s must be a finite number >= 0, got {max_delay_s!r}")


class FixedPolicy:
    """TorchServe's rule: wait until the batch is full or ``max_delay_s`` has passed."""

    __slots__ = ("max_batch_size", "max_delay_s")

    def __init__(self, max_batch_size: int, max_delay_s: float) -> None:
        _check_limits(max_batch_size, max_delay_s)
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s

    def on_arrival(self, now: float) -> None:
        pass

    def on_completed(self, size: int, service_s: float, now: float) -> None:
        pass

    def wait_s(self, queued: int, waited_s: float, idle_workers: int, now: float) -> float:
        if queued >= self.max_batch_size:
            return 0.0
        return self.max_delay_s - waited_s

    def use_buckets(self, buckets: Sequence[int]) -> None:
        pass  # TorchServe's rule knows no buckets: a batch is padded in the worker

    def batch_items(self, queued: int, idle_workers: int, now: float) -> int:
        return self.max_batch_size


#: Arrivals the rate estimate looks back over. A window of arrivals (not of time) adapts as fast
#: at 2 req/s as at 2000, and forgets a long silence once that many jobs have come after it.
ARRIVAL_WINDOW = 16
#: Fewer arrivals than this and the rate is unknown, so a job is dispatched at once.
MIN_ARRIVALS = 4
#: A silence this many mean gaps long means the stream has paused (Poisson odds: e^-4 < 2 %).
STALE_GAPS = 4.0
#: EWMA weight of one completed batch in the service-time fit (a memory of ~10 batches).
SERVICE_ALPHA = 0.1
#: Batch sizes must vary at least this much (variance, items^2) to fit a slope.
MIN_SIZE_VARIANCE = 0.1
#: EWMA weight of one answered job in the echo ratio.
ECHO_ALPHA = 0.1
#: Gains and margin of the echo delay estimate (RFC 6298's smoothed RTT: 1/8, 1/4, 4).
ECHO_DELAY_GAIN = 0.125
ECHO_DEVIATION_GAIN = 0.25
ECHO_MARGIN = 4.0


class _ServiceFit:
    """s(n) = a + b*n fitted to completed batches by least squares with exponential forgetting.

    Until batch sizes have varied, the slope is unknown and is taken as s/n (a = 0): a model
    with no fixed cost per batch gains nothing from waiting, which keeps the policy greedy
    until the data say otherwise. Greedy dispatch under load produces varied sizes by itself.
    """

    __slots__ = (
        "_mean_n",
        "_mean_nn",
        "_mean_ns",
        "_mean_s",
        "_slope",
        "count",
        "overhead_s",
        "per_item_s",
    )

    def __init__(self) -> None:
        self._mean_n = self._mean_s = self._mean_nn = self._mean_ns = 0.0
        #: Last slope fitted from varied sizes; kept while sizes stay the same (a full queue).
        self._slope: float | None = None
        self.count = 0
        self.overhead_s = 0.0
        self.per_item_s = 0.0

    def add(self, size: int, service_s: float) -> None:
        if size < 1 or not math.isfinite(service_s) or service_s < 0:
            return
        n, s = float(size), service_s
        if self.count == 0:
            self._mean_n, self._mean_s, self._mean_nn, self._mean_ns = n, s, n * n, n * s
        else:
            alpha = SERVICE_ALPHA
            self._mean_n += alpha * (n - self._mean_n)
            self._mean_s += alpha * (s - self._mean_s)
            self._mean_nn += alpha * (n * n - self._mean_nn)
            self._mean_ns += alpha * (n * s - self._mean_ns)
        self.count += 1
        variance = self._mean_nn - self._mean_n * self._mean_n
        steepest = self._mean_s / self._mean_n  # the line through the origin: a = 0
        if variance >= MIN_SIZE_VARIANCE:
            slope = (self._mean_ns - self._mean_n * self._mean_s) / variance
            self._slope = min(max(slope, 0.0), steepest)
        slope = steepest if self._slope is None else min(self._slope, steepest)
        self.per_item_s = slope
        self.overhead_s = self._mean_s - slope * self._mean_n


class AdaptivePolicy:
    """Dispatches at once unless the jobs it expects will come soon enough to pay for the wait.

    With s(n) = a + b*n the batch service time fitted from completed batches, waiting for j
    more jobs over T seconds instead of serving the q queued ones now (and the j in a batch of
    their own) pays when ``(q + j) * T < j * (a - b * q)``. Two predictions of j and T, each
    O(1) to keep and to read:

    * the arrival rate: the mean gap g over the last ``ARRIVAL_WINDOW`` arrivals, j the jobs
      expected within the budget, T = j * g. It lets go as soon as no job has come for
      ``STALE_GAPS * g`` (the stream has paused).
    * echoes: clients that send their next request when answered (closed loop, as every load
      generator) come back a short delay after each completed batch. The policy learns which
      share of the answered jobs comes back within ``max_delay_s`` and how fast (T = the
      delay's mean + ``ECHO_MARGIN`` deviations), and counts one more cost of splitting: the
      queued jobs' own echoes find the worker busy with the second batch.

    It dispatches at once when the queue holds ``max_batch_size``, while another worker is
    idle, before the first batch has completed, and never waits past ``max_delay_s``.

    With batch buckets (``use_buckets``, issue 33) a batch costs what its padded rows cost (a
    second line, fitted over rows). A wait is the shorter of the wait without buckets and the
    same tests on that line with the padding a wait would land the batch in charged: it may end
    sooner at a bucket, never later. And a batch leaves at the largest size that needs no
    padding (``batch_items``: 4 of 5 queued, with buckets 4 and 8, as Triton's preferred batch
    sizes) when the rest is not held up by it: another worker is free to take the rest at once,
    or the rest, run alone right after, is done no later than in the padded batch, which then
    costs the worker more than both. docs/batching.md has the derivation and simulated numbers.
    """

    __slots__ = (
        "_arrivals",
        "_count",
        "_echo_at",
        "_echo_delay_s",
        "_echo_deviation_s",
        "_echo_outstanding",
        "_echo_ratio",
        "_echo_samples",
        "_fit",
        "_next",
        "_rows_fit",
        "_table",
        "max_batch_size",
        "max_delay_s",
    )

    def __init__(self, max_batch_size: int, max_delay_s: float) -> None:
        _check_limits(max_batch_size, max_delay_s)
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s
        # A ring of the last arrival times: O(1) per arrival, allocated once.
        self._arrivals = [0.0] * ARRIVAL_WINDOW
        self._next = 0
        self._count = 0
        self._fit = _ServiceFit()
        self._echo_at = -math.inf
        self._echo_outstanding = 0
        self._echo_ratio = 0.0
        self._echo_delay_s = 0.0
        self._echo_deviation_s = 0.0
        self._echo_samples = 0
        #: The batch buckets' arithmetic up to max_batch_size (None: no buckets), and the
        #: service time as a line of the padded rows the workers ran.
        self._table: BucketTable | None = None
        self._rows_fit = _ServiceFit()

    # -- hooks ------------------------------------------------------------------------------

    def on_arrival(self, now: float) -> None:
        self._expire_echoes(now)
        if self._echo_outstanding > 0:
            self._echo_outstanding -= 1
            self._echo_ratio += ECHO_ALPHA * (1.0 - self._echo_ratio)
            self._add_echo_delay(now - self._echo_at)
        self._arrivals[self._next] = now
        self._next = (self._next + 1) % ARRIVAL_WINDOW
        self._count = min(self._count + 1, ARRIVAL_WINDOW)

    def on_completed(self, size: int, service_s: float, now: float) -> None:
        self._fit.add(size, service_s)
        if self._table is not None:  # the worker ran the batch's padded rows
            self._rows_fit.add(self._table.rows_of(size), service_s)
        self._expire_echoes(now)
        self._echo_outstanding += max(size, 0)
        self._echo_at = now

    # -- the decision -----------------------------------------------------------------------

    def wait_s(self, queued: int, waited_s: float, idle_workers: int, now: float) -> float:
        budget = self.max_delay_s - waited_s
        missing = self.max_batch_size - queued
        if missing <= 0 or budget <= 0 or queued < 1 or idle_workers > 1:
            return 0.0
        if self._fit.count == 0:
            return 0.0  # the cost of a batch is unknown: nothing says waiting pays
        wait = self._wait(queued, missing, budget, now, self._fit, None)
        if wait > 0 and self._table is not None and self._rows_fit.count:
            # The same tests, the cost a line of the padded rows and the padding charged: a
            # bucket-aware wait that is never longer than the wait without buckets.
            wait = min(wait, self._wait(queued, missing, budget, now, self._rows_fit,
                                        self._table))
        return min(wait, budget)

    def _wait(self, queued: int, missing: int, budget: float, now: float, fit: _ServiceFit,
              table: BucketTable | None) -> float:
        """``wait_s`` with the cost of a batch ``fit`` (and its padding to ``table``'s
        buckets), the guards passed."""
        # What splitting costs: the late jobs pay a second batch's fixed cost a, while
        # joining this batch costs each queued job b per newcomer.
        saving_s = fit.overhead_s - fit.per_item_s * queued
        wait = 0.0
        gap = self.mean_gap_s()
        if gap is not None and gap > 0:
            last = self._last_arrival()
            expected = min(float(missing), budget / gap)
            if (now < last + STALE_GAPS * gap and expected >= 1
                    and (queued + expected) * gap
                    < saving_s - _padding_s(table, fit, queued, expected)[0] / expected):
                # Until the batch should be full; asked again on every arrival, it lets go
                # once no job has come for STALE_GAPS gaps (the stream has paused).
                wait = last + max(float(missing), STALE_GAPS) * gap - now
        if self._echo_outstanding > 0 and self._echo_samples > 0:
            # Echoes come within H = mean delay + ECHO_MARGIN deviations of the answers. The
            # decision charges all of H, not what is left of it: late in the horizon the wait
            # looks short, but then the echoes are unlikely to come at all.
            horizon_s = self._echo_delay_s + ECHO_MARGIN * self._echo_deviation_s
            expected = min(float(missing), self._echo_ratio * self._echo_outstanding)
            # Splitting also keeps the worker busy a - H longer, right when the queued jobs'
            # own echoes come back: they pay that too.
            behind_s = self._echo_ratio * queued * max(0.0, fit.overhead_s - horizon_s)
            # A closed loop repeats its rounds: splitting this one into two batches costs the
            # fixed overhead a once more every round, and joining costs only the echoes' delay.
            # So echoes (more likely than not to come) are waited for when they come sooner
            # than a, even where this round alone would be served sooner split.
            padding_s, round_padding_s = _padding_s(table, fit, queued, expected)
            rounds_pay = expected > 0.5 and horizon_s < fit.overhead_s - round_padding_s
            if (now < self._echo_at + horizon_s and expected > 0
                    and (rounds_pay or (queued + expected) * horizon_s
                         < expected * saving_s + behind_s - padding_s)):
                wait = max(wait, self._echo_at + horizon_s - now)
        return wait

    def use_buckets(self, buckets: Sequence[int]) -> None:
        table = BucketTable(buckets, self.max_batch_size) if buckets else None
        if table is None or self._table is None or table.buckets != self._table.buckets:
            self._rows_fit = _ServiceFit()  # a line of other rows: learnt afresh
        self._table = table

    def batch_items(self, queued: int, idle_workers: int, now: float) -> int:
        limit, table = self.max_batch_size, self._table
        if table is None:
            return limit
        items = min(queued, limit)
        fits = table.fits[items]  # the largest batch of at most ``items`` with no padding
        if fits in (0, items):
            return limit
        if idle_workers > 1:
            return fits  # the rest goes to another free worker at once (the Batcher's rule)
        if self._rows_fit.count == 0:
            return limit  # the cost of a batch is unknown: as without buckets
        # The rest, run alone right after, is done no later than in the padded batch (and the
        # worker is busy less long): a + b*(fits + R(rest)) < b*R(items).
        rows, fit = table.rows, self._rows_fit
        if fit.overhead_s + fit.per_item_s * (fits + rows[items - fits]) \
                < fit.per_item_s * rows[items]:
            return fits
        return limit

    # -- estimates (read-only, also for tests and metrics) ----------------------------------

    def mean_gap_s(self) -> float | None:
        """Mean time between the last ``ARRIVAL_WINDOW`` arrivals; None while too few."""
        if self._count < MIN_ARRIVALS:
            return None
        oldest = self._arrivals[self._next] if self._count == ARRIVAL_WINDOW else self._arrivals[0]
        return max(0.0, self._last_arrival() - oldest) / (self._count - 1)

    @property
    def service_model(self) -> tuple[float, float] | None:
        """The fitted (a, b) of s(n) = a + b*n in seconds; None before the first batch."""
        if self._fit.count == 0:
            return None
        return self._fit.overhead_s, self._fit.per_item_s

    @property
    def echo_ratio(self) -> float:
        """Share of answered jobs whose client sent another within ``max_delay_s``."""
        return self._echo_ratio

    # -- internals --------------------------------------------------------------------------

    def _last_arrival(self) -> float:
        return self._arrivals[self._next - 1]  # index -1 wraps to the end of the ring

    def _expire_echoes(self, now: float) -> None:
        if self._echo_outstanding > 0 and now - self._echo_at > self.max_delay_s:
            # Echoes later than the longest wait are no use: count them as not coming.
            self._echo_ratio *= (1.0 - ECHO_ALPHA) ** self._echo_outstanding
            self._echo_outstanding = 0

    def _add_echo_delay(self, delay_s: float) -> None:
        if self._echo_samples == 0:
            self._echo_delay_s, self._echo_deviation_s = delay_s, delay_s / 2
        else:
            error = delay_s - self._echo_delay_s
            self._echo_deviation_s += ECHO_DEVIATION_GAIN * (abs(error) - self._echo_deviation_s)
            self._echo_delay_s += ECHO_DELAY_GAIN * error
        self._echo_samples += 1


def _padding_s(table: BucketTable | None, fit: _ServiceFit, queued: int, expected: float
               ) -> tuple[float, float]:
    """What padding to ``table``'s buckets adds to joining the ``expected`` jobs to the
    ``queued`` ones, beyond what ``fit``'s line charges (0 without buckets, and never below 0:
    padding may end a wait sooner, never later): the jobs' completion seconds in all, and the
    worker's seconds a round. With R the padded rows, j jobs joining q cost the q
    b*(R(q+j) - R(q) - j) more, and the j b*(R(q+j) - R(q) - R(j)) more than a batch of their
    own (docs/batching.md)."""
    if table is None:
        return 0.0, 0.0
    rows, per_row = table.rows, fit.per_item_s
    joining = max(1, min(len(rows) - 1 - queued, round(expected)))
    both, alone = rows[queued + joining], rows[queued] + rows[joining]
    extra = queued * (both - rows[queued] - joining) + joining * (both - alone)
    return per_row * max(0, extra), per_row * max(0, both - alone)


def make_policy(name: str, max_batch_size: int, max_delay_s: float) -> BatchPolicy:
    """Build the policy a model's ``batch_policy`` setting names ("fixed" or "adaptive")."""
    try:
        kind = PolicyName(name.strip().lower() if isinstance(name, str) else name)
    except ValueError:
        choices = ", ".join(repr(p.value) for p in PolicyName)
        raise ValueError(f"unknown batch_policy {name!r}; choose one of {choices}") from None
    if kind is PolicyName.FIXED:
        return FixedPolicy(max_batch_size, max_delay_s)
    return AdaptivePolicy(max_batch_size, max_delay_s)
