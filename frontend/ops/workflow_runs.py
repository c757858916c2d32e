"""Running a workflow's DAG for one prediction (``/wfpredict/{name}``).

Every node call is an ordinary prediction of the node's model through the inference plane:
its queue, its batcher, its workers. So the calls of concurrent workflow requests that reach
the same node form batches there, together with direct ``/predictions`` traffic to that
model; each call is in that model's metrics and the access log.

How a node's input is made, as TorchServe 0.12 (its ``DagExecutor``): the start node gets the
request itself (its body, or its form fields, with their content types, and its headers); a
node with one parent gets that parent's output as ``body``; a node with several parents gets
one input per parent, named by the parent node. A parent's output reaches its children as
bytes (``application/octet-stream``: a handler reads ``row.get("body")`` or
``row.get("node").decode()``, whatever the client's Content-Type), and every node call carries
the request's headers. Nodes whose parents are done run at once, so parallel branches run
concurrently. The answer is the leaf's output (several leaves: a JSON object of their outputs,
by node name).

A node call that fails or outlives the node's ``timeout-ms`` is made again, up to
``retry-attempts`` more times (TorchServe's rule), except where again cannot help: the node's
queue is full, or its model is going away. Then the request alone fails, with an error naming
the node (500, as TorchServe; 503 when the node could not take it); the other requests in the
node's batches are not touched, and nodes still running for the failed request are cancelled.
A client's ``X-Request-Timeout`` bounds the whole workflow (504 when it passes).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from frontend.errors import (
    GatewayTimeout,
    InternalError,
    NotFound,
    ServeError,
    ServiceUnavailable,
    excerpt,
)
from frontend.observe.metrics import ServerMetrics
from frontend.ops.plane import Call, InferencePlane, Origin, request_timeout
from frontend.serving.streams import ResponseStream
from frontend.workflows.registry import Workflow, WorkflowNode, WorkflowRegistry
from frontend.workflows.spec import NodeSpec
from protos import worker_pb2

logger = logging.getLogger(__name__)

Inputs = Sequence[tuple[str, bytes, str | None]]
Headers = Sequence[tuple[bytes, bytes]]

#: How a parent's output reaches its children: bytes, as TorchServe passes them.
NODE_OUTPUT_TYPE = "application/octet-stream"
JSON_TYPE = "application/json"


@dataclass(frozen=True, slots=True)
class Output:
    """A node's output, and what a workflow prediction answers (the leaf's output, or the
    leaves' outputs joined)."""

    body: bytes
    content_type: str


class NodeFailed(ServeError):
    """A node of a workflow failed a request (after its retries): that request's answer."""

    def __init__(self, status: int, type_name: str, message: str) -> None:
        super().__init__(message)
        self.http_status = status
        self.type_name = type_name


class _NoRetry(Exception):
    """A node call that another attempt cannot help (full queue, model going away)."""

    def __init__(self, error: ServeError) -> None:
        super().__init__(error.message)
        self.error = error


class WorkflowRunner:
    """Runs workflow predictions: one ``run`` per request."""

    def __init__(self, registry: WorkflowRegistry, plane: InferencePlane,
                 metrics: ServerMetrics) -> None:
        self.registry = registry
        self.plane = plane
        self.metrics = metrics

    def open(self, name: str) -> Workflow:
        """The workflow a request names, before its body is read: WorkflowNotFound (404), or
        503 at once when the start node's queue is full or the workflow is going away."""
        workflow = self.registry.get(name)
        if not workflow.accepting:
            raise ServiceUnavailable(f"Workflow {name} is being unregistered")
        self.plane.refuse_if_full(workflow.nodes[workflow.spec.root].model)
        return workflow

    async def run(self, call: Call, workflow: Workflow, headers: Headers,
                  inputs: Inputs) -> Output:
        """Run the DAG for the request of ``call``; its answer, or the ServeError it is
        answered with. The plane records the call as the workflow's (its metrics and access
        line, once, however it ends), and each node call as its model's."""
        if not workflow.accepting:
            raise ServiceUnavailable(f"Workflow {workflow.name} is being unregistered")
        call.workflow = workflow.name
        workflow.begin_run()
        try:
            timeout_s = request_timeout(headers)
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            return await self._execute(workflow, call.origin.for_nodes(), headers, inputs,
                                       deadline)
        finally:
            workflow.end_run()

    async def _execute(self, workflow: Workflow, origin: Origin, headers: Headers,
                       inputs: Inputs, deadline: float | None) -> Output:
        spec = workflow.spec
        outputs: dict[str, Output] = {}
        waiting = {node.name: len(node.parents) for node in spec}
        running: dict[asyncio.Task[Output], str] = {}
        ready: list[tuple[str, Inputs]] = [(spec.root, inputs)]
        try:
            while ready or running:
                if len(ready) == 1 and not running:
                    # One node to run and nothing else: no task needed (a sequential DAG).
                    node, node_inputs = ready.pop()
                    finished = [(node, await self._call(workflow, workflow.nodes[node], origin,
                                                        headers, node_inputs, deadline))]
                else:
                    for node, node_inputs in ready:
                        task = asyncio.ensure_future(self._call(
                            workflow, workflow.nodes[node], origin, headers, node_inputs,
                            deadline))
                        running[task] = node
                    ready = []
                    done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                    finished = []
                    failure: BaseException | None = None
                    for task in done:  # every exception retrieved, the first one raised
                        node = running.pop(task)
                        error = task.exception()
                        if error is None:
                            finished.append((node, task.result()))
                        elif failure is None:
                            failure = error
                    if failure is not None:
                        raise failure
                for node, output in finished:
                    outputs[node] = output
                    for child in spec[node].children:
                        waiting[child] -= 1
                        if not waiting[child]:
                            ready.append((child, _child_inputs(spec[child], outputs)))
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
        return _answer(spec.leaves, outputs)

    async def _call(self, workflow: Workflow, node: WorkflowNode, origin: Origin,
                    headers: Headers, inputs: Inputs, deadline: float | None) -> Output:
        """Call one node for one request, with its retries; NodeFailed when it fails."""
        settings = node.spec.settings
        attempts = 1 + settings.retry_attempts
        error: ServeError = InternalError("no attempt was made")
        made = 0
        #: Whether the client's deadline, not the node's timeout-ms, bounds this attempt.
        cut = False
        for attempt in range(1, attempts + 1):
            timeout_s = settings.timeout_ms / 1000
            if deadline is not None:
                left = deadline - time.monotonic()
                cut = left <= timeout_s
                if left <= 0:
                    break
                timeout_s = min(timeout_s, left)
            made = attempt
            try:
                output = await self._attempt(node, origin, headers, inputs, timeout_s)
            except _NoRetry as stop:
                self.metrics.record_workflow_node(workflow.name, node.name, "unavailable")
                raise _failure(workflow, node, stop.error, attempt) from None
            except ServeError as exc:
                error = exc
                outcome = "timeout" if isinstance(exc, GatewayTimeout) else "error"
                self.metrics.record_workflow_node(workflow.name, node.name, outcome)
                if cut and outcome == "timeout":
                    break  # the client's deadline passed: no time for another call
                if attempt < attempts:
                    logger.warning("workflow %s: node %s failed attempt %d of %d (%s); "
                                   "calling it again", workflow.name, node.name, attempt,
                                   attempts, exc.message)
                continue
            self.metrics.record_workflow_node(workflow.name, node.name, "ok")
            return output
        if cut and (made == 0 or isinstance(error, GatewayTimeout)):
            # The client's own X-Request-Timeout: 504, as /predictions answers it.
            where = _where(workflow, node)
            raise NodeFailed(504, GatewayTimeout.type_name,
                             f"{where}: the request's X-Request-Timeout passed after "
                             f"{_attempts(made)} ({error.message})")
        raise _failure(workflow, node, error, made)

    async def _attempt(self, node: WorkflowNode, origin: Origin, headers: Headers,
                       inputs: Inputs, timeout_s: float) -> Output:
        """One call of the node's model through the plane (its metrics and access line)."""
        plane = self.plane
        model = node.model
        call = plane.begin(origin, asyncio.get_running_loop())
        try:
            try:
                # The very model the workflow registered, never one found by its name.
                plane.open_model(call, model, headers)
                plane.send(call, headers, inputs, deadline_s=timeout_s)
                answer = await plane.outcome(call)
            except (NotFound, ServiceUnavailable) as exc:
                # A full queue, no worker, the model going away: not worth another call.
                call.fail(exc)
                raise _NoRetry(exc) from None
            except ServeError as exc:
                call.fail(exc)
                raise
            if isinstance(answer, ResponseStream):
                answer = await _whole(answer)
            call.status = answer.status or (500 if answer.error else 200)
            if answer.error or call.status >= 400:
                detail = answer.error or answer.body[:200].decode("utf-8", "replace")
                raise InternalError(f"{model.name} answered {call.status}: "
                                    f"{excerpt(detail, 300)}")
            return Output(answer.body, answer.content_type or JSON_TYPE)
        except asyncio.CancelledError:
            call.status = 0
            raise
        finally:
            plane.end(call)


async def _whole(stream: ResponseStream) -> worker_pb2.Response:
    """A streamed answer as one response: its parts' bodies joined (or its first error)."""
    parts = [part async for part in stream]
    failed = next((part for part in parts if part.error), None)
    if failed is not None:
        return failed
    last = parts[-1] if parts else worker_pb2.Response(status=200)
    return worker_pb2.Response(request_id=last.request_id, status=last.status or 200,
                               content_type=parts[0].content_type if parts else "",
                               body=b"".join(part.body for part in parts))


def _child_inputs(node: NodeSpec, outputs: dict[str, Output]) -> Inputs:
    """A node's inputs: ``body`` from its one parent, else one per parent, by its name."""
    return [(node.input_name(parent), outputs[parent].body, NODE_OUTPUT_TYPE)
            for parent in node.parents]


def _answer(leaves: tuple[str, ...], outputs: dict[str, Output]) -> Output:
    if len(leaves) == 1:
        output = outputs[leaves[0]]
        return Output(output.body, output.content_type)
    # Several leaves: their outputs by node name (TorchServe's: each must be a JSON object;
    # here any JSON value, and text that is not JSON as a string).
    combined: dict[str, object] = {}
    for leaf in leaves:
        body = outputs[leaf].body
        try:
            combined[leaf] = json.loads(body)
        except (ValueError, RecursionError):
            combined[leaf] = body.decode("utf-8", "replace")
    return Output((json.dumps(combined, indent=2) + "\n").encode(), JSON_TYPE)


def _where(workflow: Workflow, node: WorkflowNode) -> str:
    return f"Error executing {node.name} (workflow {workflow.name}, model {node.model.name})"


def _attempts(count: int) -> str:
    return f"{count} attempt{'s' if count != 1 else ''}"


def _failure(workflow: Workflow, node: WorkflowNode, error: ServeError, attempts: int
             ) -> NodeFailed:
    """The answer of a request a node failed: 500 as TorchServe's (its message starts as
    TorchServe's, "Error executing <node>"), or 503 when the node could not take it."""
    where = _where(workflow, node)
    if isinstance(error, ServiceUnavailable):
        return NodeFailed(503, ServiceUnavailable.type_name, f"{where}: {error.message}")
    return NodeFailed(500, InternalError.type_name,
                      f"{where} after {_attempts(attempts)}: {error.message}")
