"""Loading and unloading model versions: archives and downloads, settings, workers.

``ModelLoader.register`` downloads (http/https URLs, into the model store) or resolves the
archive, unpacks it into the run directory, resolves the settings (server defaults <
config.properties ``models=`` < model-config.yaml < the API), checks the Open Inference
metadata, installs the model's own packages (frontend/models/dependencies.py), adds the
``Model`` to the registry and starts its workers. Whatever fails on the way leaves nothing
behind: not the download, not the unpacked archive, not the installed packages, not a
half-registered model. ``unregister`` and ``close`` undo it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frontend import __version__
from frontend.config import ConfiguredVersion, ServerConfig
from frontend.errors import BadRequest, Forbidden, InternalError, quoted
from frontend.models import archive as archives
from frontend.models.dependencies import NO_ENVIRONMENT, DependencyInstaller, ModelEnvironment
from frontend.models.download import download_archive
from frontend.models.model import Model, TensorMetadata
from frontend.models.registry import ModelRegistry
from frontend.models.residency import Residency, residency_limits
from frontend.observe.events import Observers
from frontend.observe.metric_specs import DEFAULT_METRICS_CONFIG
from frontend.processes import worker_environment
from frontend.serving.devices import DeviceGroups
from frontend.serving.forkserver import ForkServer, Launch, fork_unsupported
from frontend.serving.placement import Placement
from frontend.serving.workers import WorkerLaunch, start_failures
from frontend.settings import FIELDS, ModelSettings, SettingsLayer, Source, read_layer, resolve
from model_archiver import names
from protos import worker_pb2

logger = logging.getLogger(__name__)

#: Open Inference Protocol datatypes model-config.yaml may name.
DATATYPES = frozenset({"BOOL", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32",
                       "UINT64", "FP16", "FP32", "FP64", "BYTES"})


_PARALLEL = ("not applied: each worker is one process on at most one GPU (no torchrun, no "
             "LOCAL_RANK/WORLD_SIZE); describe shows it as TorchServe does")
_SEQUENCE = "honoured: the limits of a stateful model's sequences"

#: What TorchServe's model-config.yaml keys beyond the batch and worker settings (which the
#: registration's own log line shows) do here: one log line each, at registration.
MODEL_CONFIG_KEYS: dict[str, str] = {
    "deviceType": "honoured: cpu keeps this model's workers off the GPUs; gpu uses them when "
                  "the server has some",
    "deviceIds": "honoured: this model's workers take these GPUs round robin",
    "parallelType": _PARALLEL,
    "parallelLevel": _PARALLEL,
    "torchrun": _PARALLEL,
    "jobQueueSize": "honoured: this model's queue bound (503 when full)",
    "clientTimeoutInMills": "honoured: the deadline of a request whose client sets none "
                            "(504 when it is still queued then)",
    "maxRetryTimeoutInSec": "shown by describe; a failing worker is restarted with capped "
                            "backoff for as long as it fails",
    "useJobTicket": "not applied: requests wait in the bounded queue (jobQueueSize) while "
                    "every worker is busy instead of being refused",
    "sequenceBatching": "honoured: each sequence's requests run in order on one worker",
    "sequenceMaxIdleMSec": _SEQUENCE,
    "sequenceTimeoutMSec": _SEQUENCE,
    "maxNumSequence": _SEQUENCE,
    "maxSequenceJobQueueSize": _SEQUENCE,
    "continuousBatching": "not applied as such: a stateful model's requests run as sequence "
                          "batching, each request one batch item; a sequence closes on its "
                          "end header or the handler's",
    "asyncCommunication": "not applied: a worker gets whole batches (up to batches_in_flight) "
                          "and answers each request once, or in parts it streams",
    "useVenv": "honoured: the workers run in a venv of the model's own",
}


def log_model_config(name: str, version: str, model_config: Mapping[str, Any]) -> None:
    """Say, for each of TorchServe's model-config.yaml keys the archive sets, what it does."""
    for key, meaning in MODEL_CONFIG_KEYS.items():
        if key in model_config:
            logger.info("model %s version %s: model-config.yaml %s=%s: %s", name, version, key,
                        json.dumps(model_config[key], default=str), meaning)


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a registration will add, checked before anything is installed for it."""

    name: str
    version: str
    handler: str
    settings: ModelSettings
    tensors: TensorMetadata
    #: Always loaded, with residency limits on: ``pinned: true``, or the operator's own
    #: ``minWorkers`` above 0 (config.properties ``models=``).
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class RegisterRequest:
    """A registration: from the management API, the startup model list or a snapshot."""

    url: str
    model_name: str | None = None
    handler: str | None = None
    #: The settings the request sets (above model-config.yaml).
    settings: SettingsLayer = field(default_factory=lambda: SettingsLayer())
    #: Settings proposed below config.properties ``models=`` and model-config.yaml (a
    #: workflow's node workers and timeouts, which TorchServe lets the archive override).
    underlay: SettingsLayer = field(default_factory=lambda: SettingsLayer())
    synchronous: bool = True
    loaded_at_startup: bool = False
    #: Named by the operator (load_models, --models): a local path there needs no
    #: allowed_urls, which guards what API clients may load (the SageMaker toolkit starts
    #: ``--models model=/opt/ml/model``); a URL to download is still checked.
    given_by_operator: bool = False
    #: The workflow the model is a node of (frontend/workflows/), or None.
    workflow: str | None = None
    #: A workflow's function node: offered whole batches, called per request if it does not
    #: take them (backend/service/workflow_functions.py).
    workflow_function: bool = False


def tensor_metadata(config: Mapping[str, Any], key: str) -> list[dict[str, Any]]:
    """model-config.yaml's ``inputs`` or ``outputs``: a list of {name, datatype, shape} (-1 for
    a variable dimension); [] when absent. Raises BadRequest when malformed."""
    entries = config.get(key)
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise BadRequest(f"model-config.yaml: {key} must be a list of tensors")
    tensors = []
    for index, entry in enumerate(entries):
        where = f"model-config.yaml: {key}[{index}]"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
            raise BadRequest(f"{where} must have a name")
        datatype = entry.get("datatype")
        if datatype not in DATATYPES:
            raise BadRequest(f"{where}: datatype must be one of {', '.join(sorted(DATATYPES))}, "
                             f"got {quoted(datatype)}")
        shape = entry.get("shape", [-1])
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= -1 for d in shape):
            raise BadRequest(f"{where}: shape must be a list of sizes (-1: variable)")
        tensors.append({"name": entry["name"], "datatype": datatype, "shape": shape})
    return tensors


class ModelLoader:
    """Registers and unregisters model versions for one server."""

    def __init__(self, config: ServerConfig, run_dir: Path, registry: ModelRegistry,
                 placement: Placement, observers: Observers, model_log: logging.Logger, *,
                 forkserver: Launch | None = None) -> None:
        self.config = config
        #: Who is told what each model version's batches and workers do, and of each version
        #: registered and removed (the server's observers: frontend/observe/events.py).
        self._observers = observers
        self.run_dir = run_dir
        self.archive_dir = run_dir / "models"
        self.archive_dir.mkdir(mode=0o700, exist_ok=True)
        self.registry = registry
        self._placement = placement
        self._model_log = model_log
        #: Tenants' weights when the server tells requests apart by tenant (``tenant_header``
        #: or ``tenant_weights``: docs/scheduling.md); None when it does not.
        self.tenants: dict[str, float] | None = (
            dict(config.tenant_weights) if config.tenants_told_apart else None)
        #: The devices shared by models that name a ``deviceGroup`` (frontend/serving/devices.py).
        self.devices = DeviceGroups()
        limits = residency_limits(config)
        #: Which models are loaded, with residency limits on (None: all of them, always).
        self.residency = Residency(limits, registry, placement, observers) if limits.on \
            else None
        self._dependencies = DependencyInstaller(
            run_dir / "envs", config.install_py_dep_per_model, config.install_py_dep_timeout_s,
            model_log)
        #: Forks the workers of models that allow it (None: every worker starts fresh).
        self.forkserver: ForkServer | None = None
        unsupported = fork_unsupported()
        if unsupported:
            logger.info("workers start as fresh interpreters: %s", unsupported)
        else:
            self.forkserver = ForkServer(sys.executable,
                                         worker_environment(config.blacklist_env_vars),
                                         model_log, config.fork_preload, launched=forkserver)

    # ---- settings -----------------------------------------------------------------------

    def server_defaults(self, at_startup: bool = True) -> SettingsLayer:
        """The bottom layer: the server's defaults for every setting.

        Workers, as TorchServe: a model loaded at start-up gets ``default_workers_per_model``,
        else one worker per GPU, else one per CPU core (the cores this process may use: in a
        container or under taskset, not the host's); one registered through the management
        API gets ``default_workers_per_model`` when it is set, else none until scaled. The
        count this server works out itself (not one asked for) is kept within the worker caps:
        a pod on a big node has many cores and little memory.
        """
        config = self.config
        workers = config.default_workers_per_model
        if at_startup and not workers:
            workers = self._placement.gpus.count or self._placement.cores
            room = self._placement.room()
            if room is not None:
                workers = min(workers, room)
        # Each setting names the ServerConfig field of its default (frontend/settings.py).
        layer = {declared.name: getattr(config, declared.server_default)
                 for declared in FIELDS if declared.server_default is not None}
        layer["min_workers"] = workers
        return layer

    def _configured(self, name: str, version: str) -> ConfiguredVersion:
        """What config.properties ``models=`` says of this version (nothing: the defaults)."""
        return self.config.models.get(name, {}).get(version) or ConfiguredVersion()

    def settings(self, name: str, version: str, request: RegisterRequest,
                 model_config: Mapping[str, Any]) -> ModelSettings:
        configured = self._configured(name, version)
        try:
            from_yaml = read_layer(model_config, Source.YAML)
        except ValueError as exc:
            raise BadRequest(f"model-config.yaml: {exc}") from None
        try:  # every value is in its range (a layer no parser read: a workflow's spec)
            settings = resolve(self.server_defaults(request.loaded_at_startup),
                               request.underlay, configured.settings, from_yaml,
                               request.settings)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if settings.sequence_batching and not settings.sequence_max_idle_ms:
            # TorchServe registers such a model and then refuses every request (503).
            raise BadRequest("model-config.yaml: sequenceBatching needs sequenceMaxIdleMSec > 0 "
                             "(how long an idle sequence is kept)")
        return settings

    # ---- lifecycle ----------------------------------------------------------------------

    async def register(self, request: RegisterRequest) -> Model:
        """Download or find, unpack and validate a model version, add it to the registry and
        start its workers.

        With ``synchronous`` it returns once every initial worker has loaded the model, and
        a model whose workers fail to load is removed again (nothing stays half-registered).
        """
        url = request.url
        downloaded: Path | None = None
        if url.lower().startswith(("http://", "https://")):
            if self.config.model_store is None:
                raise BadRequest("no model store is configured to download the archive into")
            downloaded = await asyncio.to_thread(
                download_archive, url, self.config.model_store, self.config.allowed_urls,
                self.config.max_archive_size_bytes)
            logger.info("downloaded %s into the model store as %s", url, downloaded.name)
            url = downloaded.name  # snapshots restore it from the store
        try:
            return await self._register(request, url)
        except BaseException:
            if downloaded is not None:
                # A refused registration leaves nothing behind in the model store.
                downloaded.unlink(missing_ok=True)
            raise

    async def _register(self, request: RegisterRequest, url: str) -> Model:
        allowed = archives.OPERATOR_URLS if request.given_by_operator \
            else self.config.allowed_urls
        source = archives.resolve_url(url, self.config.model_store, allowed)
        unpacked = await asyncio.to_thread(archives.unpack, url, source, self.archive_dir)
        environment = NO_ENVIRONMENT
        try:
            plan = self._plan(request, unpacked)
            environment = await self._dependencies.prepare(
                plan.name, plan.version, unpacked.model_dir,
                unpacked.manifest.requirements_file, plan.settings.use_venv)
            # registry.add checks the name again: a registration of the same version, or a
            # workflow's node of that name, may have been added while this one installed.
            model = self._add(request, unpacked, plan, environment)
        except BaseException:
            archives.remove_unpacked(unpacked, self.archive_dir)
            environment.remove()
            raise
        if self.residency is None:
            workers = model.start_workers(model.settings.min_workers)
        else:
            try:
                self.residency.enroll(model, plan.pinned)
                workers = await self.residency.admit(model, model.settings.startup_timeout_s)
            except BaseException:
                await self._remove(model, drain_timeout_s=0)
                raise
        if not request.synchronous or not workers:
            return model
        failures = await start_failures(workers)
        if failures:
            await self._remove(model, drain_timeout_s=0)
            raise InternalError(str(failures[0]) + self._not_installed_note(unpacked))
        return model

    def _not_installed_note(self, unpacked: archives.UnpackedArchive) -> str:
        """Why a handler may miss its packages: the archive's requirements were not installed."""
        requirements = unpacked.manifest.requirements_file
        if not requirements or self.config.install_py_dep_per_model:
            return ""
        return (f" (the archive's requirements file {requirements} was not installed: "
                "install_py_dep_per_model is false)")

    def _plan(self, request: RegisterRequest, unpacked: archives.UnpackedArchive) -> _Plan:
        """The name, version, handler and settings of a registration, checked."""
        manifest = unpacked.manifest
        name = request.model_name or manifest.model_name or ""
        version = manifest.model_version or "1.0"
        problem = names.name_problem(name) or names.version_problem(version)
        if problem:
            raise BadRequest(problem)
        self.registry.check_free(name, version, request.workflow)
        if request.handler:
            archives.check_handler(request.handler, "the handler parameter")
        handler = request.handler or manifest.handler or self.config.default_service_handler
        if not handler:
            raise BadRequest(f"model {quoted(name)} names no handler: pass handler=")
        settings = self.settings(name, version, request, unpacked.model_config)
        # Early, before its packages are installed; _add asks again as its workers start.
        self._placement.admit(name, settings.min_workers, settings.max_workers, 0)
        operator_workers = self._configured(name, version).settings.get("min_workers", 0)
        return _Plan(name, version, handler, settings,
                     TensorMetadata(tensor_metadata(unpacked.model_config, "inputs"),
                                    tensor_metadata(unpacked.model_config, "outputs")),
                     pinned=settings.pinned or operator_workers > 0)

    def _add(self, request: RegisterRequest, unpacked: archives.UnpackedArchive, plan: _Plan,
             environment: ModelEnvironment) -> Model:
        name, version, settings = plan.name, plan.version, plan.settings
        # The worker caps, counted with no await before its workers start (_register).
        self._placement.admit(name, settings.min_workers, settings.max_workers, 0)
        launch = self._launch(name, version, unpacked, plan.handler, settings, environment,
                              request.workflow_function)
        try:
            model = Model(name, version, unpacked, plan.handler, settings, launch,
                          self._placement, self._model_log, request.loaded_at_startup,
                          plan.tensors, environment, request.workflow, self.tenants)
            self.registry.add(model,
                              make_default=self._configured(name, version).is_default_version)
        except BaseException:
            if launch.device is not None:
                self.devices.leave(launch.device)
            raise
        self._observers.registered(name, version)
        log_model_config(name, version, unpacked.model_config)
        logger.info("registered model %s version %s (batch_size=%d, max_batch_delay=%d ms, "
                    "workers=%d)", name, version, settings.batch_size,
                    settings.max_batch_delay_ms, settings.min_workers)
        return model

    def _launch(self, name: str, version: str, unpacked: archives.UnpackedArchive,
                handler: str, settings: ModelSettings,
                environment: ModelEnvironment, workflow_function: bool = False
                ) -> WorkerLaunch:
        config = self.config
        return WorkerLaunch(
            load=worker_pb2.LoadModel(
                model_name=name,
                model_version=version,
                model_dir=str(unpacked.model_dir),
                handler=handler,
                batch_size=settings.batch_size,
                workflow_function=workflow_function,
                manifest_json=unpacked.manifest_json,
                limit_max_image_pixels=config.limit_max_image_pixels,
                envelope=config.service_envelope,
                decode_input_request=config.decode_input_request,
                server_version=__version__,
                response_timeout_ms=settings.response_timeout_s * 1000,
                dependency_dirs=environment.dependency_dirs,
                metrics_config=str(config.metrics_config or DEFAULT_METRICS_CONFIG),
            ),
            events=self._observers.of_model(name, version),
            run_dir=self.run_dir,
            startup_timeout_s=settings.startup_timeout_s,
            response_timeout_s=settings.response_timeout_s,
            max_response_bytes=config.max_response_size_bytes,
            # Telling tenants apart, a worker holds one batch at a time: a second batch sent
            # ahead would be fixed before a later, fairer request could take its place
            # (docs/scheduling.md: the light tenant's p99 1.83x -> 1.35x its alone figure).
            batches_in_flight=1 if self.tenants is not None else config.batches_in_flight,
            python=environment.python,
            env_blocklist=config.blacklist_env_vars,
            forkserver=self._forkserver_for(name, version, settings, environment),
            device=self.devices.join(settings.device_group, name, version,
                                     settings.device_weight)
            if settings.device_group else None,
        )

    def _forkserver_for(self, name: str, version: str, settings: ModelSettings,
                        environment: ModelEnvironment) -> ForkServer | None:
        """The fork server for this version's workers, or None: they start fresh (asked
        for, or the model has packages of its own, which the fork server has not imported)."""
        if settings.worker_start == "spawn" or self.forkserver is None:
            return None
        if environment.python != sys.executable or environment.dependency_dirs:
            logger.info("model %s version %s: its workers start as fresh interpreters (it has "
                        "packages of its own)", name, version)
            return None
        return self.forkserver

    async def unregister(self, name: str, version: str | None = None) -> Model:
        model = self.registry.get(name, version)
        if (version is not None and self.registry.default_version(name) == version
                and len(self.registry.versions(name)) > 1):
            raise Forbidden(f"Cannot remove default version {version} for model {name}")
        await self._remove(model, self.config.unregister_model_timeout_s)
        return model

    async def remove(self, model: Model, drain_timeout_s: float | None) -> None:
        """Unregister this very version (a workflow's node model), draining its queue within
        ``drain_timeout_s``; nothing when it is gone already."""
        if self.registry.holds(model):
            await self._remove(model, drain_timeout_s)

    async def _remove(self, model: Model, drain_timeout_s: float | None) -> None:
        self.registry.remove(model)
        self._observers.removed(model.name, model.version)
        if self.residency is not None:
            self.residency.forget(model)
        await model.stop(drain_timeout_s)
        if model.launch.device is not None:
            self.devices.leave(model.launch.device)
        archives.remove_unpacked(model.archive, self.archive_dir)
        await asyncio.to_thread(model.environment.remove)  # a venv can be large
        logger.info("unregistered model %s version %s", model.name, model.version)

    async def close(self, drain_timeout_s: float) -> None:
        """Stop every model, draining in-flight requests within ``drain_timeout_s``, then the
        fork server."""
        try:
            if self.residency is not None:
                await self.residency.close()
            await asyncio.gather(*(self._remove(model, drain_timeout_s)
                                   for model in list(self.registry)))
        finally:
            if self.forkserver is not None:
                await self.forkserver.close()

