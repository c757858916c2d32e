"""The management operations, shared by the REST API and the gRPC ManagementAPIsService.

Each operation takes TorchServe's parameters as strings (REST query parameters; the gRPC
servicer converts its request message into the same form) and returns the HTTP status and
the JSON body, so both transports answer with the same text.

A workflow's node models (``{workflow}__{node}``) are listed and described, and answer
predictions, as other models do; but they are the workflow's: registering a version under
such a name is refused (409, by the registry), and so are scaling one, setting its default
and unregistering it (403): they change only with their workflow (``/workflows``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Mapping

import psutil

from frontend.errors import BadRequest, Forbidden, InternalError, MethodNotAllowed, quoted
from frontend.models.loader import RegisterRequest
from frontend.models.model import Model
from frontend.observe.batches import BatchRecords, ModelBatches
from frontend.observe.tenant_metrics import TenantMetrics
from frontend.ops.params import bool_param, int_param
from frontend.ops.plane import InferencePlane
from frontend.ops.services import Services
from frontend.serving.workers import Worker, WorkerState, start_failures
from frontend.settings import Source, read_layer
from protos import worker_pb2

MAX_LIST_LIMIT = 100
Body = dict[str, object] | list[dict[str, object]]


class ManagementOps:
    """Register, list, describe, scale, set-default and unregister models."""

    def __init__(self, services: Services) -> None:
        self.config = services.config
        self.registry = services.registry
        self.loader = services.loader
        self.plane = services.plane
        self.snapshots = services.snapshots
        #: What is kept of each model version's batches (its describe's ``batching``).
        self.records = services.metrics.records
        #: Each tenant's requests (its describe's ``scheduling``).
        self.tenants = services.metrics.tenants

    def _require_model_api(self) -> None:
        if not self.config.enable_model_api:
            raise MethodNotAllowed(
                "Model API is disabled: start with --enable-model-api (or "
                "enable_model_api=true) to register or unregister models at runtime.")

    def list_models(self, params: dict[str, str]) -> dict[str, object]:
        limit = page_limit(params)
        start = int_param(params, "next_page_token", 0, minimum=0)
        # A workflow's function nodes are not listed, as TorchServe lists only its model
        # nodes (their url would be the server's own unpacked copy of the archive).
        names = [name for name in self.registry.names()
                 if not self.registry.get(name).is_workflow_function]
        page = names[start:start + limit]
        body: dict[str, object] = {}
        if start + limit < len(names):
            body["nextPageToken"] = str(start + limit)
        body["models"] = [
            {"modelName": name, "modelUrl": self.registry.get(name).archive.url}
            for name in page
        ]
        return body

    async def describe(self, name: str, version: str | None,
                       customized: bool) -> list[dict[str, object]]:
        models = (self.registry.versions(name) if version == "all"
                  else [self.registry.get(name, version)])
        gpus = {worker.gpu_id for model in models for worker in model.workers
                if worker.gpu_id is not None}
        usage = dict(zip(gpus, await asyncio.gather(*(gpu_usage(gpu) for gpu in gpus)),
                         strict=True))
        descriptions = [describe_model(model, self.records, usage, self.tenants)
                        for model in models]
        if customized:
            for model, description in zip(models, descriptions, strict=True):
                description["customizedMetadata"] = await _customized_metadata(self.plane,
                                                                               model)
        return descriptions

    async def register(self, params: dict[str, str]) -> tuple[int, Body]:
        self._require_model_api()
        if not params.get("url"):
            raise BadRequest("Parameter url is required.")
        runtime = params.get("runtime", "python")
        if runtime not in ("python", "python3"):
            raise BadRequest(f"unsupported runtime {quoted(runtime)}: only python is supported")
        try:  # MLServer's and KServe's names for the batch settings are accepted too
            settings = read_layer(params, Source.API)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        request = RegisterRequest(
            url=params["url"],
            model_name=params.get("model_name") or None,
            handler=params.get("handler") or None,
            settings=settings,
            # TorchServe's code defaults synchronous to true for REST (its docs say false).
            synchronous=bool_param(params, "synchronous", True),
        )
        model = await self.loader.register(request)
        self.snapshots.save(self.registry)
        # 202 while workers start in the background; 200 when there was nothing to wait for.
        return (200 if request.synchronous or not model.workers else 202,
                {"status": _registered_message(model, request.synchronous)})

    def _own_model(self, name: str, version: str | None, change: str) -> Model:
        """The model version a management change names, unless a workflow owns it
        (Forbidden: it changes only with its workflow)."""
        model = self.registry.get(name, version)
        if model.workflow is not None:
            raise Forbidden(f"Model {name} is a node of workflow {model.workflow}: it cannot "
                            f"be {change} on its own; it goes with its workflow (DELETE "
                            f"/workflows/{model.workflow}, and register the workflow again "
                            "to change it)")
        return model

    async def scale(self, name: str, version: str | None,
                    params: dict[str, str]) -> tuple[int, Body]:
        model = self._own_model(name, version, "scaled")
        int_param(params, "number_gpu", 0, minimum=0)
        min_worker = int_param(params, "min_worker", 1, minimum=0)
        max_worker = int_param(params, "max_worker", min_worker, minimum=0)
        if max_worker < min_worker:
            raise BadRequest("max_worker cannot be less than min_worker.")
        synchronous = bool_param(params, "synchronous", False)
        # -1: wait for the batches in flight (TorchServe's default), else seconds.
        timeout = int_param(params, "timeout", -1, minimum=-1)
        started = await model.scale(min_worker, max_worker,
                                    None if timeout < 0 else float(timeout))
        self.snapshots.save(self.registry)
        if not synchronous:
            return 202, {"status": "Processing worker updates..."}
        failures = await start_failures(started)
        if failures:
            raise InternalError(f"Failed to start workers for model {name}: {failures[0]}")
        suffix = f", version: {version}" if version else ""
        return 200, {"status": f"Workers scaled to {min_worker} for model: {name}{suffix}"}


    def set_default(self, name: str, version: str) -> Body:
        self._own_model(name, version, "given another default version")
        self.registry.set_default(name, version)
        self.snapshots.save(self.registry)
        return {"status": f'Default version successfully updated for model "{name}" '
                          f'to "{version}"'}

    async def unregister(self, name: str, version: str | None) -> Body:
        self._require_model_api()
        self._own_model(name, version, "unregistered")
        model = await self.loader.unregister(name, version)
        self.snapshots.save(self.registry)
        suffix = f' version "{version}"' if version else ""
        return {"status": f'Model "{model.name}"{suffix} unregistered'}


def page_limit(params: dict[str, str]) -> int:
    """A list's ``limit``: TorchServe's page size, 100 when it is not in 1..100 (an int32
    all the same, as its gRPC field)."""
    limit = int_param(params, "limit", MAX_LIST_LIMIT)
    return MAX_LIST_LIMIT if limit <= 0 or limit > MAX_LIST_LIMIT else limit


async def _customized_metadata(plane: InferencePlane, model: Model) -> object:
    """Ask a worker for the handler's describe_handle() output, through the model's queue."""
    response = await plane.ask(model, worker_pb2.Request(request_id=str(uuid.uuid4()),
                                                         describe=True))
    if not isinstance(response, worker_pb2.Response):
        raise InternalError("describe_handle() must not stream")
    if response.error:
        raise InternalError(f"describe failed: {response.error}")
    if response.content_type.startswith("application/json"):
        return json.loads(response.body)
    return response.body.decode("utf-8", "replace")


def _registered_message(model: Model, synchronous: bool) -> str:
    workers = len(model.workers)
    text = f'Model "{model.name}" Version: {model.version} registered with {workers} ' \
           "initial workers"
    if workers == 0 and model.residence is not None:
        text += " (paged out: its first request loads it)"
    elif workers == 0:
        text += ". Use scale workers API to add workers for the model."
    elif not synchronous:
        text += ". Processing worker updates..."
    return text


def describe_model(model: Model, records: BatchRecords,
                   gpu_usage: Mapping[int, str] | None = None,
                   tenants: TenantMetrics | None = None) -> dict[str, object]:
    """TorchServe 0.12's describe body for one model version (its fields in its order), with
    our ``batching`` section (what ``records`` kept of its batches), and for a model that
    tells tenants apart its ``scheduling`` (``tenants``: their requests); ``gpu_usage`` maps
    GPU ids to each worker's ``gpuUsage``."""
    s = model.settings
    batches = records.of(model.name, model.version) or ModelBatches(records.dispatch_stats)
    sizes = list(batches.recent_sizes)
    reasons, fill = batches.dispatch.recent_summary()
    return {
        "modelName": model.name,
        "modelVersion": model.version,
        "modelUrl": model.archive.url,
        "runtime": model.archive.manifest.runtime or "python",
        **s.torchserve_fields(),
        "maxRetryTimeoutInSec": s.max_retry_timeout_s,
        "clientTimeoutInMills": s.client_timeout_ms,
        # model-config.yaml's keys as TorchServe shows them (what each does here is logged
        # at registration: frontend/models/loader.py).
        **s.parallel_fields(),
        "deviceType": "gpu" if model.uses_gpus else "cpu",
        **({"deviceIds": ids} if (ids := model.device_ids) is not None else {}),
        "continuousBatching": s.continuous_batching,
        "useJobTicket": s.use_job_ticket,
        "useVenv": s.use_venv,
        **s.sequence_fields(),
        "loadedAtStartup": model.loaded_at_startup,
        "status": model.health(),
        "handler": model.handler,
        "workers": [describe_worker(worker, gpu_usage or {}) for worker in model.workers],
        "jobQueueStatus": {
            "remainingCapacity": model.batcher.remaining_capacity,
            "pendingRequests": model.batcher.depth,
        },
        # Residency limits on (docs/residency.md): loaded, loading, paged out or evicting.
        **({"residency": model.residence.fields()} if model.residence is not None else {}),
        "batching": {
            "policy": s.batch_policy.value,
            "queueDepth": model.batcher.depth,
            "inFlightBatches": sum(w.in_flight for w in model.workers),
            "batchesTotal": batches.batches_total,
            "requestsTotal": batches.requests_total,
            "recentBatchSizes": sizes,
            "meanBatchSize": round(sum(sizes) / len(sizes), 3) if sizes else 0.0,
            # Why the recent batches left the queue, and how full they were (docs/batches.md).
            "dispatchReasons": reasons,
            "batchFill": fill,
            # The batch buckets in effect (its workers' executions agree on them) and how its
            # batches fitted them since it was registered (docs/batching.md).
            "buckets": {"sizes": list(model.buckets), **batches.buckets.fields()},
            **({"openSequences": model.sequences.open_sequences}
               if model.sequences is not None else {}),
        },
        # Its share of a device's time, with the other models of its deviceGroup
        # (docs/devices.md).
        **({"device": device.fields()} if (device := model.device_status()) is not None
           else {}),
        **({"scheduling": describe_scheduling(model, tenants)} if model.tenanted else {}),
    }


def describe_scheduling(model: Model, tenants: TenantMetrics | None) -> dict[str, object]:
    """A tenanted model's queue (docs/scheduling.md): fair or FIFO (a stateful model), each
    tenant's weight, queued requests and what was answered (``requests``, ``ok``: status 200,
    ``refused_<reason>``), its priority levels."""
    s, fair = model.settings, model.fair
    seen = tenants.of_model(model.name, model.version) if tenants is not None else {}
    queued = fair.tenants() if fair is not None else {}
    return {
        "queue": "fair" if fair is not None else "fifo",
        "tenants": {name: {**queued.get(name, {}), **seen.get(name, {})}
                    for name in sorted({*queued, *seen})},
        "priorityLevels": s.priority_levels,
        "defaultPriorityLevel": s.default_priority_level or s.priority_levels,
        "priorityQueuePolicy": {str(level): {"maxQueueSize": size, "timeoutMs": timeout_ms}
                                for level, size, timeout_ms in s.priority_queue_policy},
        **({"costLearned": fair.costs.learned, "itemCostMs": round(fair.costs.item_s * 1000, 3)}
           if fair is not None else {}),
    }


def describe_worker(worker: Worker, gpu_usage: Mapping[int, str] | None = None
                    ) -> dict[str, object]:
    gpu = worker.gpu_id
    return {
        "id": worker.id,
        "startTime": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(worker.start_time)),
        "status": "READY" if worker.state is WorkerState.READY
        else "UNLOADING" if worker.state in (WorkerState.STOPPING, WorkerState.STOPPED)
        else worker.state.value,
        "memoryUsage": _memory_usage(worker.pid),
        "pid": worker.pid if worker.pid is not None else -1,
        "gpu": gpu is not None,
        "gpuUsage": "N/A" if gpu is None else (gpu_usage or {}).get(gpu, NO_GPU_USAGE),
        **({"gpuId": gpu} if gpu is not None else {}),
        "restarts": worker.restarts,
        # How this life of the worker started (forked, fresh) and how long it took to be
        # READY: its handler initialised and warmed up.
        **({"startMode": worker.start_mode.value} if worker.start_mode is not None else {}),
        **({"loadTimeMs": round(worker.load_time_ms)} if worker.load_time_ms is not None
           else {}),
        # How it runs batches: its mode, batch buckets, why it fell back from CUDA graphs,
        # their memory pool, as the worker reported when it loaded.
        **({"execution": execution.fields()} if (execution := worker.execution) is not None
           else {}),
        **({"cpus": list(worker.cpus)} if worker.cpus else {}),
        **({"cpuThreads": worker.threads} if worker.threads else {}),
        **({"lastError": worker.last_error} if worker.last_error else {}),
    }


#: A GPU worker's ``gpuUsage`` when nvidia-smi cannot tell (TorchServe's words).
NO_GPU_USAGE = "failed to obtained gpu usage"
NVIDIA_SMI_TIMEOUT_S = 2.0


async def gpu_usage(gpu_id: int) -> str:
    """TorchServe's ``gpuUsage`` text for one GPU, from nvidia-smi, e.g.
    ``gpuId::0 utilization.gpu [%]::37 % utilization.memory [%]::12 % memory.used [MiB]::5120
    MiB``."""
    try:
        process = await asyncio.create_subprocess_exec(
            "nvidia-smi", "-i", str(gpu_id),
            "--query-gpu=utilization.gpu,utilization.memory,memory.used", "--format=csv",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    except OSError:
        return NO_GPU_USAGE
    try:
        out, _ = await asyncio.wait_for(process.communicate(), NVIDIA_SMI_TIMEOUT_S)
    except TimeoutError:
        process.kill()
        await process.wait()
        return NO_GPU_USAGE
    lines = out.decode("utf-8", "replace").strip().splitlines()
    if process.returncode != 0 or len(lines) < 2:
        return NO_GPU_USAGE
    names = [part.strip() for part in lines[0].split(",")]
    values = [part.strip() for part in lines[1].split(",")]
    return " ".join([f"gpuId::{gpu_id}",
                     *(f"{name}::{value}" for name, value in zip(names, values, strict=False))])


def _memory_usage(pid: int | None) -> int:
    if pid is None:
        return 0
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0
