"""The workflow management operations (``/workflows`` on the management port), with
TorchServe 0.12's parameters, bodies and statuses (its ``WorkflowMgmtRequestHandler``):

* ``POST /workflows?url=&workflow_name=`` (also ``response_timeout``, ``startup_timeout``):
  200 ``{"status": "Workflow wf has been registered and scaled successfully."}``; 400 without
  a url, for a bad spec or DAG; 404 when the archive is not found; 409 when the name is taken;
  500 when a node fails to register (``Workflow wf has failed to register. Failures: [...]``).
* ``GET /workflows[?limit=&next_page_token=]``: ``{"nextPageToken"?, "workflows":
  [{"workflowName", "workflowUrl"}]}``.
* ``GET /workflows/{name}``: ``[{"workflowName", "workflowUrl", "minWorkers", "maxWorkers",
  "batchSize", "maxBatchDelay", "workflowDag"}]`` (the spec's global settings, the DAG as
  TorchServe prints it), and ours: ``nodes``, each node's model and its workers.
* ``DELETE /workflows/{name}``: 200 ``{"status": "Workflow \\"wf\\" unregistered"}``.

Registering and unregistering need the model API (``enable_model_api``), as models do
(TorchServe leaves workflows open); both keep the server's state only here, not in
snapshots (as TorchServe).
"""

from __future__ import annotations

from frontend.errors import MethodNotAllowed
from frontend.observe.batches import BatchRecords
from frontend.ops.management import describe_model, page_limit
from frontend.ops.params import int_param
from frontend.ops.services import Services
from frontend.settings import MAX_TIMEOUT_S
from frontend.workflows.registry import Workflow
from frontend.workflows.spec import dag_text

_MODEL_FIELDS = ("modelVersion", "minWorkers", "maxWorkers", "batchSize", "maxBatchDelay",
                 "responseTimeout", "status", "handler", "workers", "jobQueueStatus",
                 "batching")


class WorkflowOps:
    """Register, list, describe and unregister workflows."""

    def __init__(self, services: Services) -> None:
        self.config = services.config
        self.loader = services.workflows
        self.registry = services.workflows.registry
        self.records = services.metrics.records

    def _require_model_api(self) -> None:
        if not self.config.enable_model_api:
            raise MethodNotAllowed(
                "Model API is disabled: start with --enable-model-api (or "
                "enable_model_api=true) to register or unregister workflows at runtime.")

    async def register(self, params: dict[str, str]) -> dict[str, object]:
        self._require_model_api()
        # 0: the node models' own (or the server's default).
        timeouts = {key: int_param(params, key, 0, minimum=0, maximum=MAX_TIMEOUT_S)
                    for key in ("response_timeout", "startup_timeout")}
        workflow = await self.loader.register(
            params.get("url", ""), params.get("workflow_name") or None,
            response_timeout_s=timeouts["response_timeout"] or None,
            startup_timeout_s=timeouts["startup_timeout"] or None)
        return {"status": f"Workflow {workflow.name} has been registered and scaled "
                          "successfully."}

    def list_workflows(self, params: dict[str, str]) -> dict[str, object]:
        limit = page_limit(params)
        start = max(0, int_param(params, "next_page_token", 0))  # TorchServe: below 0 is 0
        names = self.registry.names()
        body: dict[str, object] = {}
        if start + limit < len(names):
            body["nextPageToken"] = str(start + limit)
        body["workflows"] = [{"workflowName": name,
                              "workflowUrl": self.registry.get(name).archive.url}
                             for name in names[start:start + limit]]
        return body

    def describe(self, name: str) -> list[dict[str, object]]:
        return [describe_workflow(self.registry.get(name), self.records)]

    async def unregister(self, name: str) -> dict[str, object]:
        self._require_model_api()
        await self.loader.unregister(name)
        return {"status": f'Workflow "{name}" unregistered'}


def describe_workflow(workflow: Workflow, records: BatchRecords) -> dict[str, object]:
    """TorchServe's describe body for a workflow, with each node's model and workers."""
    spec = workflow.spec
    nodes = []
    for name, node in workflow.nodes.items():
        model = describe_model(node.model, records)
        nodes.append({
            "name": name,
            "type": node.spec.kind.value,
            "modelName": node.model.name,
            **({"url": node.spec.url} if node.spec.url is not None else {}),
            "parents": list(node.spec.parents),
            "children": list(node.spec.children),
            "retryAttempts": node.spec.settings.retry_attempts,
            "timeoutMs": node.spec.settings.timeout_ms,
            **{key: model[key] for key in _MODEL_FIELDS if key in model},
        })
    settings = spec.settings
    return {
        "workflowName": workflow.name,
        "workflowUrl": workflow.archive.url,
        "minWorkers": settings.min_workers,
        "maxWorkers": settings.max_workers,
        "batchSize": settings.batch_size,
        "maxBatchDelay": settings.max_batch_delay_ms,
        "workflowDag": dag_text(workflow.archive.spec_text),
        "retryAttempts": settings.retry_attempts,
        "timeoutMs": settings.timeout_ms,
        "running": workflow.running,
        "nodes": nodes,
    }
