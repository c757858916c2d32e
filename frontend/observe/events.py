"""What the serving core tells its observers: plain facts, and who listens to them.

The core (the batcher and dispatch in frontend/serving, a model version in frontend/models,
the inference plane in frontend/ops) keeps no record for anyone to read. Where something
happens it notes raw facts (times on its own clocks, sizes, why a batch left its queue, what
the worker replied, how a call ended) and publishes one of these events:

* a batch **formed**: it left its model's queue (``Batch``: why, how many items, when);
* a batch **ended**: its worker's reply was read and its answers delivered, or it was lost
  with its worker (timed out, died): the same ``Batch``, with what its worker did to it;
* a call **ended**: a prediction was answered, refused or left by its client (``CallFacts``);
* a worker **loaded** its model.

Every record built from them (the metrics, the request phases, the dispatch reasons and the
batch fill, busy time, traces, the live page, the access log) belongs to an observer in this
folder, subscribed at the composition root (frontend/server.py) to what it needs. An event
nobody listens to costs a ``None`` test where it happens: an observer that is off does none of
its work, and the facts only it would read are not taken.

These types live here, on the observers' floor, so that both sides import them: serving
publishes them (it may import observe), observe reads them (it may not import serving).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from frontend.errors import QueueFull, ServeError
from protos import worker_pb2

# Why a batch left its queue (docs/batches.md; ``batchserve_dispatch_total``'s reason label).
#: It held max_batch_size items when a worker waiting for it took it.
FULL = "full"
#: The wait ran out: max_batch_delay after the batch's first job was found.
MAX_DELAY = "max_delay"
#: The adaptive policy let it go early: nobody else was expected soon enough to pay.
ADAPTIVE = "adaptive"
#: A queued job's deadline would have passed before the policy's wait ended.
DEADLINE = "deadline"
#: A worker with a batch in flight took a full batch as soon as it had room for a second
#: (batches_in_flight).
SLOT_FREE = "slot_free"
#: A stateful model's batch (sequence batching), whatever the policy decided.
SEQUENCE = "sequence"
REASONS = (FULL, MAX_DELAY, ADAPTIVE, DEADLINE, SLOT_FREE, SEQUENCE)

#: A model version: (name, version).
ModelKey = tuple[str, str]


class Batch:
    """One batch, from the moment it left its queue: what the batcher, the dispatcher and the
    exchange note of it, raw. Shared by its jobs (``JobFacts.batch``); one is made per batch,
    none per request. Times are on the batcher's clock (time.monotonic(); the dispatcher reads
    the same one), except the ``frontend_marks``."""

    __slots__ = ("__weakref__", "answered", "ended_at", "frontend_marks", "handler_ms",
                 "items", "left_at", "limit", "reason", "replied", "rows", "service_s",
                 "since", "step_ms", "steps", "worker")

    def __init__(self, reason: str, items: int, limit: int, left_at: float,
                 since: float) -> None:
        self.reason = reason
        #: Its items (a KServe request counts its instances), and the model's batch_size.
        self.items = items
        self.limit = limit
        #: When it left the queue, and when a free worker began collecting it.
        self.left_at = left_at
        self.since = since
        #: The id of the worker it was sent to ("" until sent).
        self.worker = ""
        #: The rows that worker runs it as: its items padded to the worker's batch buckets
        #: (frontend/serving/buckets.py); 0 until sent, and when the worker runs any size.
        self.rows = 0
        #: When its reply was read, or it was given up (timed out, its worker died).
        self.ended_at = 0.0
        #: Seconds its worker had it: from when the worker could start it to ``ended_at``.
        self.service_s = 0.0
        #: A reply frame came back (a result or an error); ``answered``: a result, whose
        #: handler times below are set.
        self.replied = False
        self.answered = False
        #: The handler's time on it, as the worker reports it; the preprocess, inference and
        #: postprocess ms the worker timed (None: it timed none, as a worker that sends no
        #: phases), and whether the handler has those three steps.
        self.handler_ms = 0.0
        self.step_ms: tuple[float, float, float] | None = None
        self.steps = False
        #: time.perf_counter() as the frontend began and finished its frame, then began and
        #: finished its reply (its answers delivered); only when someone reads them
        #: (``ModelEvents.frontend_time``), else None.
        self.frontend_marks: list[float] | None = None

    def note_reply(self, result: worker_pb2.PredictResult) -> None:
        """The worker answered it: what it says of its handler's time."""
        self.answered = True
        self.handler_ms = result.handler_time_ms
        if result.HasField("phases"):
            phases = result.phases
            if phases.steps or phases.inference_ms:
                self.steps = phases.steps
                self.step_ms = (phases.preprocess_ms, phases.inference_ms,
                                phases.postprocess_ms)


#: The tenant of a request that names none (docs/scheduling.md).
DEFAULT_TENANT = "default"


@dataclass(slots=True, eq=False)
class JobFacts:
    """What is known of one request's trip through its model's queue (the serving core's
    ``Job`` is one, with the means to answer it)."""

    request: worker_pb2.Request
    #: The batcher's clock when it entered the queue.
    enqueued_at: float = field(default=0.0, kw_only=True)
    #: The batch it left the queue in (None: not dispatched, or put back in the queue).
    batch: Batch | None = field(default=None, kw_only=True)
    #: Which batch it rode in, as the client may be told (KServe's batchId), once sent.
    batch_id: str = field(default="", kw_only=True)
    #: Who sent it (``tenant_header``, or a tenant's inference key), and its priority level
    #: (0: none given; the fair queue puts it at its level), docs/scheduling.md.
    tenant: str = field(default=DEFAULT_TENANT, kw_only=True)
    priority: int = field(default=0, kw_only=True)

    @property
    def queue_wait_s(self) -> float:
        """Seconds it waited in the queue (0 until it left)."""
        batch = self.batch
        return batch.left_at - self.enqueued_at if batch is not None else 0.0

    @property
    def form_s(self) -> float:
        """Of ``queue_wait_s``, the time a free worker spent collecting its batch (the rest: no
        worker was free for it)."""
        batch = self.batch
        if batch is None:
            return 0.0
        enqueued = self.enqueued_at
        return batch.left_at - (batch.since if batch.since > enqueued else enqueued)

    @property
    def batch_size(self) -> int:
        """The items of the batch it rode in (0 until it left)."""
        batch = self.batch
        return batch.items if batch is not None else 0


#: The access log's version field on a workflow's own line (its nodes' lines name their
#: models and versions).
WORKFLOW_VERSION = "workflow"


class Origin:
    """Who asked, for the access log and the traces. (A plain class: one is made per
    request.)"""

    __slots__ = ("count_status", "method", "node", "path", "peer", "protocol", "recorded",
                 "uri")

    def __init__(self, peer: str, method: str, path: str, protocol: str,
                 count_status: bool = False, uri: str | None = None,
                 node: bool = False) -> None:
        #: The client's address as TorchServe's access log writes it: ``/127.0.0.1:41696``.
        self.peer = peer
        #: "POST", "PUT", ... or "gRPC".
        self.method = method
        #: The path (a trace's), decoded.
        self.path = path
        #: "HTTP/1.1", "HTTP/1.0", "HTTP/2.0" (gRPC).
        self.protocol = protocol
        #: Whether the answer is counted in Requests2XX/4XX/5XX when the call ends (gRPC's;
        #: an HTTP response is counted by its connection, like every other HTTP response).
        self.count_status = count_status
        #: What the access log writes of the request: the request line's target as it came
        #: (with its query), or the RPC's ``<service>/<method>``; by default the path.
        self.uri = path if uri is None else uri
        #: Its access-log line is written (by the access log, or a workflow's run).
        self.recorded = False
        #: A workflow node's call for a request: TorchServe's access log has a line for the
        #: request only; the extended one has a line for each node call too.
        self.node = node

    def for_nodes(self) -> Origin:
        """The origin of the node calls a workflow makes for this request."""
        return Origin(self.peer, self.method, self.path, self.protocol, self.count_status,
                      self.uri, node=True)


class CallFacts:
    """How one prediction went, as the inference plane notes it (its ``Call`` is one):
    published when it ends."""

    __slots__ = ("error", "job", "key", "latency_s", "origin", "started", "status", "version",
                 "workflow")

    def __init__(self, origin: Origin, job: JobFacts, started: float) -> None:
        self.origin = origin
        self.job = job
        #: time.perf_counter() when it began, and its seconds in the server once it ended.
        self.started = started
        self.latency_s = 0.0
        #: The model version it resolved to (None: it named no known model).
        self.key: ModelKey | None = None
        #: The version the request named (None: the model's default; TorchServe's metrics
        #: label it "default").
        self.version: str | None = None
        #: The status it was answered with (0: the client left before its answer).
        self.status = 500
        #: The error it was answered with, if any.
        self.error: ServeError | None = None
        #: The workflow it runs (a ``/wfpredict`` request, which names no model: ``key`` is
        #: None): its observers record it as the workflow's.
        self.workflow: str | None = None

    def answered(self) -> bool:
        """Answered by a worker (not refused, expired or failed as a whole): what TorchServe
        counts in its latency metrics."""
        return self.job.batch is not None and self.error is None and self.status != 0

    def refusal(self) -> str | None:
        """Why it was answered without running, for ``batchserve_refused_requests``: a full
        queue (503), no worker to take it (503), or its deadline passed in the queue (504);
        None when it ran, or was answered otherwise."""
        if self.status not in (503, 504) or self.job.batch is not None:
            return None
        reason: str | None = getattr(self.error, "refusal", None)
        if reason is not None:  # the fair queue's own (frontend/serving/fairness.py)
            return reason
        if isinstance(self.error, QueueFull):
            return "queue_full"
        return "deadline" if self.status == 504 else "unavailable"


#: Subscribers, each told the model version an event is of.
BatchFormed = Callable[[ModelKey, Batch], None]
BatchEnded = Callable[[ModelKey, Batch, Sequence[JobFacts], "worker_pb2.PredictResult | None"],
                      None]
WorkerLoaded = Callable[[ModelKey, str, float, Iterable[worker_pb2.Metric]], None]
CallEnded = Callable[[CallFacts], None]
ModelChange = Callable[[ModelKey], None]
#: A page-in's steps and their seconds (docs/residency.md).
PageInTimed = Callable[[ModelKey, dict[str, float]], None]


@dataclass(frozen=True, slots=True)
class ModelEvents:
    """What one model version's batcher, exchange and launcher publish through: each hook is
    None when nobody listens to its event (then nothing is done for it)."""

    #: A batch left the queue.
    formed: Callable[[Batch], None] | None = None
    #: A batch ended (answered, failed as a whole, or lost with its worker), with its jobs and
    #: the worker's result (None without one).
    ended: Callable[[Batch, Sequence[JobFacts], worker_pb2.PredictResult | None], None] | \
        None = None
    #: A worker (TorchServe's name for it) loaded the model in so many ms; what its handler
    #: reported while initialising.
    loaded: Callable[[str, float, Iterable[worker_pb2.Metric]], None] | None = None
    #: Someone reads the frontend's own time on each batch: the exchange marks it
    #: (``Batch.frontend_marks``).
    frontend_time: bool = False


#: A model version nobody observes (tests that build one alone).
NO_EVENTS = ModelEvents()


class Observers:
    """Who listens to what: the subscribers of each event, in the order they subscribed.
    Subscribed at the composition root before any model is registered; a model version's
    hooks are bound once, when it is (``of_model``)."""

    def __init__(self) -> None:
        self.batch_formed: list[BatchFormed] = []
        self.batch_ended: list[BatchEnded] = []
        self.worker_loaded: list[WorkerLoaded] = []
        self.call_ended: list[CallEnded] = []
        #: A model version was registered (its records start afresh) or removed.
        self.model_registered: list[ModelChange] = []
        self.model_removed: list[ModelChange] = []
        #: Residency limits on (docs/residency.md): a model version was paged in (its workers
        #: are up), was paged out to make room, and how long its page-in's steps took (told
        #: when the request that asked for it is answered).
        self.paged_in: list[ModelChange] = []
        self.evicted: list[ModelChange] = []
        self.page_in_timed: list[PageInTimed] = []
        #: An observer reads the frontend's own time on each batch (WorkerThreadTime).
        self.frontend_time = False

    def of_model(self, name: str, version: str) -> ModelEvents:
        """The hooks a model version publishes through."""
        key = (name, version)
        return ModelEvents(_bound(self.batch_formed, key, 1), _bound(self.batch_ended, key, 3),
                           _bound(self.worker_loaded, key, 3), self.frontend_time)

    def registered(self, name: str, version: str) -> None:
        for subscriber in self.model_registered:
            subscriber((name, version))

    def removed(self, name: str, version: str) -> None:
        for subscriber in self.model_removed:
            subscriber((name, version))


def _bound(subscribers: list[Callable[..., None]], key: ModelKey, facts: int
           ) -> Callable[..., None] | None:
    """One callable that tells each of ``subscribers`` of ``key``'s event, which carries
    ``facts`` facts (1 or 3); None for no subscriber."""
    if not subscribers:
        return None
    if len(subscribers) == 1:
        return functools.partial(subscribers[0], key)
    every = tuple(subscribers)

    # NOTE: the two arities spelt out: no argument tuple is packed and unpacked per batch.
    def publish_one(fact: object) -> None:
        for subscriber in every:
            subscriber(key, fact)

    def publish_three(first: object, second: object, third: object) -> None:
        for subscriber in every:
            subscriber(key, first, second, third)

    return publish_one if facts == 1 else publish_three
