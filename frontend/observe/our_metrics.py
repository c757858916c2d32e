"""batchserve's own metrics (``batchserve_*``, in every ``metrics_mode`` but ``legacy``), each
kept from the serving core's events (frontend/observe/events.py) by what it measures:

* ``RequestMetrics``: each prediction's end-to-end latency, and the requests answered without
  running (refused 503, expired 504), per model version;
* ``BatchMetrics``: each batch's size, its requests' waits in the queue and its handler's
  time, per model version;
* ``WorkflowMetrics``: each ``/wfpredict`` request and each call of a workflow's node.

Where a request's time went (the phases) is ``timing.PhaseMetrics``; why batches left and how
full they were, ``batches.BatchRecords``. An observation is a few list and dictionary updates;
the page is formatted when scraped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from frontend.observe.events import Batch, CallFacts, JobFacts, ModelKey
from frontend.observe.exposition import Family
from frontend.observe.histograms import BATCH_BUCKETS, MODEL_LABELS, TIME_BUCKETS, Histogram
from protos import worker_pb2

WORKFLOW_LABELS = ("workflow",)


class RequestMetrics:
    """Each prediction that named a known model: its latency, and why it was answered without
    running, if it was."""

    def __init__(self, workflows: WorkflowMetrics | None = None) -> None:
        #: Where a workflow's own request is recorded (it names no model).
        self.workflows = workflows
        self.latency = Histogram("batchserve_request_latency_seconds",
                                 "End-to-end latency of a prediction request, in the server",
                                 TIME_BUCKETS)
        #: (model, version, reason) -> requests answered without running.
        self.refused: dict[tuple[str, str, str], int] = {}

    def call_ended(self, call: CallFacts) -> None:
        key = call.key
        if key is None:
            if call.workflow is not None and self.workflows is not None:
                self.workflows.record_workflow(call.workflow, call.status, call.latency_s)
            return
        self.latency.observe(key, call.latency_s)
        if call.status in (503, 504):
            refused = call.refusal()
            if refused is not None:
                refusal = (*key, refused)
                self.refused[refusal] = self.refused.get(refusal, 0) + 1

    def refused_family(self) -> Family:
        family = Family("batchserve_refused_requests_total",
                        "Requests answered without running: queue full (503), no worker to take "
                        "them (503), or past their deadline while queued (504)", "counter")
        labels = (*MODEL_LABELS, "reason")
        for key, count in list(self.refused.items()):
            family.add(labels, key, float(count))
        return family


class BatchMetrics:
    """Each batch a worker's reply came back for: its size, its requests' waits in the queue,
    and its handler's time (when it was answered)."""

    def __init__(self) -> None:
        self.batch_size = Histogram("batchserve_batch_size", "Requests per dispatched batch",
                                    BATCH_BUCKETS)
        self.queue_wait = Histogram("batchserve_queue_wait_seconds",
                                    "Time a request waited in its model's queue", TIME_BUCKETS)
        self.handler_time = Histogram("batchserve_handler_seconds",
                                      "Time a worker's handler spent on one batch", TIME_BUCKETS)

    def batch_ended(self, key: ModelKey, batch: Batch, jobs: Sequence[JobFacts],
                    result: worker_pb2.PredictResult | None) -> None:
        if not batch.replied:
            return
        self.batch_size.observe(key, len(jobs))
        left = batch.left_at
        self.queue_wait.observe_all(key, [left - job.enqueued_at for job in jobs])
        if result is not None:
            self.handler_time.observe(key, result.handler_time_ms / 1000)


class WorkflowMetrics:
    """Workflows: each ``/wfpredict`` request, and each call of a node (whose model's own
    metrics count its requests, batches and latency as any model's)."""

    def __init__(self) -> None:
        self.latency = Histogram(
            "batchserve_workflow_latency_seconds",
            "End-to-end latency of a workflow prediction (/wfpredict), in the server",
            TIME_BUCKETS, WORKFLOW_LABELS)
        #: (workflow, status code) -> workflow predictions answered.
        self.requests: dict[tuple[str, str], int] = {}
        #: (workflow, node, outcome) -> calls of a node: ok, error, timeout, unavailable.
        self.node_calls: dict[tuple[str, str, str], int] = {}

    def record_workflow(self, workflow: str, status: int, latency_s: float) -> None:
        """One workflow prediction answered with ``status`` (0: its client left)."""
        key = (workflow, str(status))
        self.requests[key] = self.requests.get(key, 0) + 1
        self.latency.observe((workflow,), latency_s)

    def record_workflow_node(self, workflow: str, node: str, outcome: str) -> None:
        """One call of a workflow's node: "ok", "error", "timeout" or "unavailable"."""
        key = (workflow, node, outcome)
        self.node_calls[key] = self.node_calls.get(key, 0) + 1

    def families(self) -> Iterator[Family]:
        requests = Family("batchserve_workflow_requests_total",
                          "Workflow predictions (/wfpredict) answered, by status (0: the "
                          "client left first)", "counter")
        for key, count in list(self.requests.items()):
            requests.add((*WORKFLOW_LABELS, "code"), key, float(count))
        calls = Family("batchserve_workflow_node_calls_total",
                       "Calls of a workflow's node (retries included), by outcome: ok, error, "
                       "timeout, unavailable", "counter")
        for node_key, count in list(self.node_calls.items()):
            calls.add((*WORKFLOW_LABELS, "node", "outcome"), node_key, float(count))
        yield from (requests, calls, self.latency.family())
