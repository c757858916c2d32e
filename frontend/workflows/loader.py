"""Registering and unregistering workflows: the archive, then every node as a model.

As TorchServe 0.12 (its ``WorkflowManager``): each DAG node becomes a model named
``{workflow}__{node}``; a model node's archive is its spec ``url`` (resolved as a model
registration's: the model store, or a download ``allowed_urls`` admits), served with the
node's batch size, batch delay and workers (TorchServe starts ``max-workers`` workers); a
function node is the archive's handler file's function, served from the unpacked .war by one
worker, which calls it one request at a time, as TorchServe does (its queue still gathers
the waiting requests into batches of up to the workflow's batch size, one trip to the worker
each). The nodes register concurrently and each waits for its workers; when one fails, the
others are removed again and so is the archive (nothing stays half-registered), and the answer
lists every failure.

Unlike TorchServe, the workflow owns its node models' names (frontend/models/registry.py): a
name that is registered already, as a model or as another workflow's node, is refused at once
(409; TorchServe registers the node as one more version beside it, and its node calls, which
name no version, reach that model's default), and nothing else can take, join or change a
node's name while the workflow is registered.

Unregistering first stops new predictions, lets the running ones finish (within
``unregister_model_timeout``), then removes the node models (each drains its queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from frontend.config import ServerConfig
from frontend.errors import ServeError, TooManyWorkers, WorkflowFailed
from frontend.models.loader import ModelLoader, RegisterRequest
from frontend.models.model import Model
from frontend.settings import SettingsLayer
from frontend.workflows import archive as archives
from frontend.workflows.registry import Workflow, WorkflowNode, WorkflowRegistry
from frontend.workflows.spec import NodeSpec

logger = logging.getLogger(__name__)


class WorkflowLoader:
    """Registers and unregisters workflows for one server."""

    def __init__(self, config: ServerConfig, models: ModelLoader, registry: WorkflowRegistry,
                 work_dir: Path) -> None:
        self.config = config
        self.models = models
        self.registry = registry
        #: Where archives are unpacked (removed with their workflows).
        self.work_dir = work_dir

    async def register(self, url: str, workflow_name: str | None = None, *,
                       response_timeout_s: int | None = None,
                       startup_timeout_s: int | None = None,
                       at_startup: bool = False) -> Workflow:
        """Register the workflow archive at ``url``; returns once every node's workers are up.

        ``response_timeout_s``/``startup_timeout_s``: the node models' (None: their own or
        the server's default, as TorchServe's ``response_timeout`` applies below
        model-config.yaml); ``at_startup``: named by the operator (``load_workflows``)."""
        config = self.config
        store = config.workflow_folder
        source, fetched = await asyncio.to_thread(
            archives.locate, url, store, config.allowed_urls, config.max_archive_size_bytes,
            given_by_operator=at_startup)
        try:
            self.work_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            archive = await asyncio.to_thread(archives.unpack, url, source, self.work_dir,
                                              workflow_name or None, fetched)
        except BaseException:
            if fetched is not None:
                fetched.unlink(missing_ok=True)
            raise
        for warning in archive.spec.warnings:
            logger.warning("workflow %s: %s", archive.name, warning)
        try:
            self.registry.reserve(archive.name)
        except BaseException:
            archive.remove()
            raise
        try:
            for spec in archive.spec:
                # A node's name must be free (409 at once, before any node registers); the
                # registry checks it again as each node is added.
                self.models.registry.check_free(spec.model_name, None, archive.name)
            nodes = await self._register_nodes(archive, response_timeout_s, startup_timeout_s,
                                               at_startup)
        except BaseException:
            self.registry.release(archive.name)
            archive.remove()
            raise
        workflow = Workflow(archive, nodes)
        self.registry.add(workflow)
        logger.info("registered workflow %s (%s): nodes %s", archive.name, url,
                    ", ".join(f"{node.name} -> {node.model.name}" for node in nodes.values()))
        return workflow

    async def _register_nodes(self, archive: archives.WorkflowArchive,
                              response_timeout_s: int | None, startup_timeout_s: int | None,
                              at_startup: bool) -> dict[str, WorkflowNode]:
        specs = list(archive.spec)
        requests = [self._request(archive, spec, response_timeout_s, startup_timeout_s,
                                  at_startup) for spec in specs]
        outcomes = await asyncio.gather(*(self.models.register(request) for request in requests),
                                        return_exceptions=True)
        registered = [outcome for outcome in outcomes if isinstance(outcome, Model)]
        failures = [(request, outcome) for request, outcome in zip(requests, outcomes,
                                                                   strict=True)
                    if not isinstance(outcome, Model)]
        if not failures:
            return {spec.name: WorkflowNode(spec, model)
                    for spec, model in zip(specs, registered, strict=True)}
        await asyncio.gather(*(self._remove_model(model, 0) for model in registered))
        for _, outcome in failures:
            if not isinstance(outcome, Exception):
                raise outcome  # a cancellation: not a failure to report
        messages = [f"Workflow Node {request.model_name} failed to register. Details: "
                    f"{_describe(outcome)}" for request, outcome in failures]
        # More workers than the caps allow is the spec's fault: 400, not TorchServe's 500.
        error = TooManyWorkers if any(isinstance(outcome, TooManyWorkers)
                                      for _, outcome in failures) else WorkflowFailed
        raise error(f"Workflow {archive.name} has failed to register. Failures: "
                    f"[{', '.join(messages)}]")

    def _request(self, archive: archives.WorkflowArchive, spec: NodeSpec,
                 response_timeout_s: int | None, startup_timeout_s: int | None,
                 at_startup: bool) -> RegisterRequest:
        settings = spec.settings
        # As TorchServe: the spec's batch size and delay win over the archive's; its workers
        # (TorchServe starts max-workers) and the register call's timeouts are what the
        # archive's model-config.yaml does not set.
        layer: SettingsLayer = {"batch_size": settings.batch_size,
                                "max_batch_delay_ms": settings.max_batch_delay_ms}
        # min-workers starts nothing (TorchServe ignores it), but is held to the worker caps
        # as max-workers is: as the node's maxWorkers when it is the larger.
        underlay: SettingsLayer = {"min_workers": settings.max_workers,
                                   "max_workers": max(settings.max_workers,
                                                      settings.min_workers)}
        if response_timeout_s is not None:
            underlay["response_timeout_s"] = response_timeout_s
        if startup_timeout_s is not None:
            underlay["startup_timeout_s"] = startup_timeout_s
        if spec.is_function:
            # TorchServe gives a function batches of 1; here its queue gathers up to the
            # workflow's batch size, and the function gets the batch whole unless it answers
            # one with other than one result per request (backend/service/workflow_functions.py).
            layer["batch_size"] = max(settings.batch_size, archive.spec.settings.batch_size)
            # The unpacked .war is the function's model folder (ours: no allowed_urls check).
            return RegisterRequest(url=str(archive.directory), model_name=spec.model_name,
                                   handler=f"{archive.handler}:{spec.name}", settings=layer,
                                   underlay=underlay, loaded_at_startup=at_startup,
                                   given_by_operator=True,
                                   workflow=archive.name, workflow_function=True)
        assert spec.url is not None
        return RegisterRequest(url=spec.url, model_name=spec.model_name, settings=layer,
                               underlay=underlay, loaded_at_startup=at_startup,
                               given_by_operator=at_startup, workflow=archive.name)

    async def unregister(self, name: str) -> Workflow:
        """Remove the workflow ``name``: no new prediction starts, the running ones finish
        (within ``unregister_model_timeout``), then its node models are removed."""
        workflow = self.registry.remove(name)
        timeout_s = self.config.unregister_model_timeout_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(workflow.idle.wait(), timeout_s)
        await asyncio.gather(*(self._remove_model(node.model, timeout_s)
                               for node in workflow.nodes.values()))
        workflow.archive.remove()
        logger.info("unregistered workflow %s", name)
        return workflow

    async def _remove_model(self, model: Model, drain_timeout_s: float) -> None:
        try:
            await self.models.remove(model, drain_timeout_s)
        except ServeError as exc:
            logger.warning("removing workflow node model %s: %s", model.name, exc.message)

    async def close(self) -> None:
        """At shutdown: forget every workflow and remove its archive (the model loader
        stops the node models with the others)."""
        for name in self.registry.names():
            self.registry.remove(name).archive.remove()


def _describe(error: BaseException) -> str:
    if isinstance(error, ServeError):
        return error.message
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
