"""The fair queue: tenants served by weight, priority levels, deadlines kept (issue 35).

A model whose requests carry tenants (``tenant_header``, or tenants' inference keys) or which
has priority levels (``priorityLevels``) queues its jobs in a ``FairQueue`` instead of the
batcher's FIFO deque; it answers the same deque operations the batcher uses (``append``,
``popleft``, ``appendleft``, ``[0]``, ``len``, iteration), so the batcher's every rule (the
policy's waits, deadlines, full batches, requeues) works unchanged on it, and a model without
either keeps the plain deque at no cost.

* Levels: strict priority, 1 the highest (Triton's numbering); each may cap its queued jobs
  (``maxQueueSize``) and give its jobs a deadline (``timeoutMs``).
* Within a level: start-time fair queuing over tenants. A job's cost is what the model is
  predicted to spend on it (``CostModel``: a batch's measured time shared by its items, per
  size bucket); a tenant's tag advances by cost / weight as its jobs are taken, the tenant
  with the smallest tag goes next, so backlogged tenants get batch room in proportion to
  their weights, and an idle tenant's share goes to the others (no tag advances while idle).
* Within a tenant: earliest deadline first.
* Admission (``admit``): while the queue has room anyone comes in (unless its level is full);
  when it is full, a tenant under its weighted share of the queue displaces the newest job of
  the tenant most over its own, so one tenant never holds ``job_queue_size`` alone and a
  tenant under its share is never refused.
* Deadlines (``hopeless``): once the costs are learned, a job that cannot be answered by its
  deadline, given the work ahead of it in this order and its own, is refused at once.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from frontend.errors import BadRequest, QueueFull, ServiceUnavailable
from frontend.observe.events import DEFAULT_TENANT as DEFAULT_TENANT
from protos import worker_pb2

#: A job's cost (seconds per item) before its model has answered any batch.
DEFAULT_ITEM_S = 0.001
#: Weight of one answered batch in a size bucket's cost (a memory of about 10 batches).
COST_ALPHA = 0.1
#: Batches answered before deadlines are judged from the costs (a cold model refuses none).
MIN_LEARNED_BATCHES = 5


class Displaced(ServiceUnavailable):
    """A queued job gave its place to a tenant under its share of the full queue (503)."""

    refusal = "displaced"

    def __init__(self, tenant: str) -> None:
        super().__init__(f"job queue is full and tenant {tenant!r} holds more than its share "
                         "of it; retry later", headers={"Retry-After": "1"})


class LevelFull(ServiceUnavailable):
    """The request's priority level holds its ``maxQueueSize`` jobs (503)."""

    refusal = "level_full"

    def __init__(self, level: int, limit: int) -> None:
        super().__init__(f"priority level {level} queue is full ({limit} requests waiting, "
                         "its maxQueueSize); retry later", headers={"Retry-After": "1"})


class DeadlineUnmeetable(ServiceUnavailable):
    """The request could not be answered by its deadline: refused now, not timed out late."""

    refusal = "deadline_unmeetable"

    def __init__(self, wait_s: float, budget_s: float) -> None:
        super().__init__(f"the work queued ahead needs about {wait_s:.3f} s, more than the "
                         f"request's {budget_s:g} s deadline; retry later",
                         headers={"Retry-After": str(max(1, math.ceil(wait_s)))})


class Queued(Protocol):
    """What the fair queue reads of a job (the batcher's ``Job``)."""

    request: worker_pb2.Request
    tenant: str
    priority: int
    deadline: float
    budget_s: float
    weight: int

    def is_live(self) -> bool: ...

    def fail(self, error: BaseException) -> None: ...


J = TypeVar("J", bound=Queued)


@dataclass(frozen=True, slots=True)
class LevelPolicy:
    """One priority level's limits (Triton's ``priority_queue_policy``): 0 means none."""

    max_queue_size: int = 0
    timeout_ms: int = 0


@dataclass(frozen=True, slots=True)
class Scheduling:
    """How one model's queue is shared: tenants' weights and the priority levels."""

    #: tenant -> weight (a tenant not listed weighs 1).
    weights: Mapping[str, float] = field(default_factory=dict)
    #: Priority levels (0: none, every job at one level).
    levels: int = 0
    #: The level of a request that names none (0: the lowest, ``levels``).
    default_level: int = 0
    #: level -> its limits.
    policies: Mapping[int, LevelPolicy] = field(default_factory=dict)

    def level_of(self, priority: int) -> int:
        """The level a request's priority (0: none given) puts it at; BadRequest out of range."""
        if self.levels == 0:
            return 1
        if priority == 0:
            return self.default_level or self.levels
        if not 1 <= priority <= self.levels:
            raise BadRequest(f"priority must be an integer from 1 (the highest) to "
                             f"{self.levels} (priorityLevels), got {priority}")
        return priority

    def timeout_s(self, level: int) -> float | None:
        policy = self.policies.get(level)
        return policy.timeout_ms / 1000 if policy is not None and policy.timeout_ms else None


class CostModel:
    """What a request is predicted to cost its model, in seconds: each answered batch's time
    shared by its items, learned per size bucket (its items, and the log2 of its body bytes)."""

    __slots__ = ("_buckets", "batches", "item_s")

    def __init__(self) -> None:
        self._buckets: dict[tuple[int, int], float] = {}
        #: The mean cost of one item over every bucket, for a bucket not seen yet.
        self.item_s = DEFAULT_ITEM_S
        self.batches = 0

    @staticmethod
    def bucket(job: Queued) -> tuple[int, int]:
        size = sum(len(data) for data in job.request.inputs.values())
        return job.weight, size.bit_length()

    @property
    def learned(self) -> bool:
        return self.batches >= MIN_LEARNED_BATCHES

    def predict(self, job: Queued) -> float:
        cost = self._buckets.get(self.bucket(job))
        return cost if cost is not None else self.item_s * job.weight

    def learn(self, jobs: Sequence[Queued], service_s: float) -> None:
        """A batch of ``jobs`` took ``service_s`` in its worker."""
        items = sum(job.weight for job in jobs)
        if items <= 0 or service_s <= 0:
            return
        per_item = service_s / items
        first = self.batches == 0
        self.batches += 1
        self.item_s = per_item if first else self.item_s + COST_ALPHA * (per_item - self.item_s)
        for job in jobs:
            key, share = self.bucket(job), per_item * job.weight
            old = self._buckets.get(key)
            self._buckets[key] = share if old is None else old + COST_ALPHA * (share - old)


class _Tenant(Generic[J]):
    """One tenant's jobs at one level: a heap by deadline, and its fair-queuing tag."""

    __slots__ = ("backlog_s", "finish", "head", "jobs", "weight")

    def __init__(self, weight: float) -> None:
        self.weight = weight
        #: (deadline, arrival number, cost, job)
        self.jobs: list[tuple[float, int, float, J]] = []
        #: The tag of its next job (while backlogged), and where its last one finished.
        self.head = 0.0
        self.finish = 0.0
        #: The predicted cost of its queued jobs.
        self.backlog_s = 0.0


class _Level(Generic[J]):
    __slots__ = ("count", "tenants", "virtual")

    def __init__(self) -> None:
        self.tenants: dict[str, _Tenant[J]] = {}
        #: The level's virtual time: the tag of the job it sent last.
        self.virtual = 0.0
        self.count = 0


class FairQueue(Generic[J]):
    """The queued jobs of one model in fair order (see the module's docstring)."""

    def __init__(self, scheduling: Scheduling, capacity: int,
                 costs: CostModel | None = None) -> None:
        self.scheduling = scheduling
        #: The model's job_queue_size.
        self.capacity = capacity
        self.costs = costs or CostModel()
        self._levels: dict[int, _Level[J]] = {}
        self._count = 0
        self._arrivals = itertools.count()
        #: Queued jobs per tenant (all levels), for admission.
        self.queued: dict[str, int] = {}
        #: Workers taking batches from this queue (the deadline check divides by them).
        self.workers = 1

    # -- the deque operations the batcher uses -----------------------------------------------

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self) -> Iterator[J]:
        for level in list(self._levels.values()):
            for tenant in list(level.tenants.values()):
                for entry in list(tenant.jobs):
                    yield entry[3]

    def __getitem__(self, index: int) -> J:
        if index != 0 or not self._count:
            raise IndexError(index)
        _, tenant = self._next()
        return tenant.jobs[0][3]

    def append(self, job: J) -> None:
        self._push(job, self.costs.predict(job), front=False)

    def appendleft(self, job: J) -> None:
        """A job put back (its worker went away): it goes next among its tenant's."""
        self._push(job, self.costs.predict(job), front=True)

    def popleft(self) -> J:
        if not self._count:
            raise IndexError("pop from an empty queue")
        level, tenant = self._next()
        _, _, cost, job = heapq.heappop(tenant.jobs)
        level.virtual = tenant.head
        tenant.head += cost / tenant.weight
        tenant.backlog_s -= cost
        if not tenant.jobs:
            tenant.finish, tenant.backlog_s = tenant.head, 0.0
        self._left(level, job)
        return job

    def clear(self) -> None:
        for level in self._levels.values():
            for tenant in level.tenants.values():
                tenant.jobs.clear()
                tenant.backlog_s = 0.0
                tenant.finish = tenant.head
            level.count = 0
        self._count = 0
        self.queued.clear()

    def retain_live(self) -> None:
        """Forget the jobs whose future is done (client gone, or expired)."""
        for level in self._levels.values():
            for tenant in level.tenants.values():
                live = [entry for entry in tenant.jobs if entry[3].is_live()]
                if len(live) == len(tenant.jobs):
                    continue
                for entry in tenant.jobs:
                    if not entry[3].is_live():
                        self._left(level, entry[3])
                heapq.heapify(live)
                tenant.jobs = live
                tenant.backlog_s = sum(entry[2] for entry in live)
                if not live:
                    tenant.finish = tenant.head

    # -- admission and deadlines ----------------------------------------------------------------

    def check(self, job: J) -> None:
        """Raise the refusal ``job`` gets now, before its body is read: a bad priority
        (BadRequest), its level full, or the queue full with nobody to give it a place."""
        level = self.scheduling.level_of(job.priority)
        policy = self.scheduling.policies.get(level)
        if policy is not None and policy.max_queue_size:
            here = self._levels.get(level)
            if here is not None and here.count >= policy.max_queue_size:
                raise LevelFull(level, policy.max_queue_size)
        capacity = self.capacity
        if self._count >= capacity and self._victim(job.tenant, capacity) is None:
            raise QueueFull(capacity)

    def enter(self, job: J, now: float, service_s: float) -> J | None:
        """Queue ``job``, which ``check`` let in, or raise DeadlineUnmeetable; returns the
        queued job it displaced (answered ``Displaced`` now), if the queue was full."""
        victim = None
        if self._count >= (capacity := self.capacity):
            victim = self._victim(job.tenant, capacity)
            assert victim is not None
            self._remove(victim)
        self.append(job)
        if job.deadline < math.inf:
            wait_s = self.wait_s(job, service_s)
            if wait_s is not None and now + wait_s > job.deadline:
                self._remove(job)
                if victim is not None:  # it keeps its place after all
                    self.appendleft(victim)
                raise DeadlineUnmeetable(wait_s, job.budget_s)
        if victim is not None:
            victim.fail(Displaced(victim.tenant))
        return victim

    def _shares(self, capacity: int, newcomer: str) -> dict[str, float]:
        weights = {name: self._weight(name) for name, count in self.queued.items() if count}
        weights[newcomer] = self._weight(newcomer)
        total = sum(weights.values())
        return {name: capacity * weight / total for name, weight in weights.items()}

    def _victim(self, tenant: str, capacity: int) -> J | None:
        """The newest job of the tenant most over its share, if ``tenant`` is under its own."""
        shares = self._shares(capacity, tenant)
        if self.queued.get(tenant, 0) + 1 > shares[tenant]:
            return None
        over = max(((count - shares[name], name) for name, count in self.queued.items()
                    if name != tenant and count > shares[name]), default=None)
        if over is None:
            return None
        newest = None
        for level in self._levels.values():
            holder = level.tenants.get(over[1])
            for entry in holder.jobs if holder is not None else ():
                if newest is None or entry[1] > newest[1]:
                    newest = entry
        return newest[3] if newest is not None else None

    def wait_s(self, job: J, service_s: float) -> float | None:
        """Seconds until ``job``, just queued, is predicted to be answered: the work ahead
        of it in fair order and its own, over the workers, and one batch in flight; None
        before the costs are learned."""
        if not self.costs.learned:
            return None
        level_no = self.scheduling.level_of(job.priority)
        ahead = 0.0
        for number, level in self._levels.items():
            if number < level_no:
                ahead += sum(tenant.backlog_s for tenant in level.tenants.values())
        level = self._levels[level_no]
        own = level.tenants[job.tenant]
        mine = sum(entry[2] for entry in own.jobs if entry[0] <= job.deadline)
        tag = own.head + (mine - self.costs.predict(job)) / own.weight
        for tenant in level.tenants.values():
            if tenant is own:
                ahead += mine
            elif tenant.jobs and tag > tenant.head:
                ahead += min(tenant.backlog_s, (tag - tenant.head) * tenant.weight)
        return ahead / max(1, self.workers) + service_s

    # -- inside --------------------------------------------------------------------------------

    def _weight(self, tenant: str) -> float:
        return self.scheduling.weights.get(tenant, 1.0)

    def _push(self, job: J, cost: float, front: bool) -> None:
        number = self.scheduling.level_of(job.priority)
        job.priority = number
        level = self._levels.get(number)
        if level is None:
            level = self._levels[number] = _Level[J]()
            self._levels = dict(sorted(self._levels.items()))
        tenant = level.tenants.get(job.tenant)
        if tenant is None:
            tenant = level.tenants[job.tenant] = _Tenant[J](self._weight(job.tenant))
        if not tenant.jobs:
            tenant.head = level.virtual if front else max(level.virtual, tenant.finish)
        elif front:
            tenant.head = max(level.virtual, tenant.head - cost / tenant.weight)
        # Put back in front: before every queued job of its tenant, the last put back first.
        arrival = next(self._arrivals)
        entry = (-math.inf, -arrival, cost, job) if front else (job.deadline, arrival, cost, job)
        heapq.heappush(tenant.jobs, entry)
        tenant.backlog_s += cost
        level.count += 1
        self._count += 1
        self.queued[job.tenant] = self.queued.get(job.tenant, 0) + 1

    def _left(self, level: _Level[J], job: J) -> None:
        level.count -= 1
        self._count -= 1
        left = self.queued[job.tenant] - 1
        if left:
            self.queued[job.tenant] = left
        else:
            del self.queued[job.tenant]

    def _remove(self, job: J) -> None:
        level = self._levels[job.priority]
        tenant = level.tenants[job.tenant]
        kept = [entry for entry in tenant.jobs if entry[3] is not job]
        tenant.backlog_s -= sum(entry[2] for entry in tenant.jobs if entry[3] is job)
        heapq.heapify(kept)
        tenant.jobs = kept
        if not kept:
            tenant.finish, tenant.backlog_s = tenant.head, 0.0
        self._left(level, job)

    def _next(self) -> tuple[_Level[J], _Tenant[J]]:
        """The level and tenant whose job goes next: the highest level with jobs, its tenant
        with the smallest tag."""
        for level in self._levels.values():
            if level.count:
                best = min((t for t in level.tenants.values() if t.jobs),
                           key=lambda t: t.head)
                return level, best
        raise IndexError("empty queue")

    def tenants(self) -> dict[str, dict[str, object]]:
        """Describe's view: each tenant's weight and queued jobs."""
        names = set(self.scheduling.weights) | set(self.queued)
        return {name: {"weight": self._weight(name), "queued": self.queued.get(name, 0)}
                for name in sorted(names)}
