"""Registering and unregistering workflows: the archive, then every node as a model.

As TorchServe 0.12 (its ``WorkflowManager``): each DAG node becomes a model named
``{workflow}__{node}``; a model node's archive is its spec ``url`` (resolved as a model
registration's: the model store, or a download ``allowed_urls`` admits), served with the
node's batch size, batch delay and workers (TorchServe starts ``max-workers`` workers); a
function node is the archive's handler file's function, served from the unpacked .war by one
worker. The nodes register concurrently and each waits for its workers; when one fails, the
others are removed again and so is the archive (nothing stays half-registered), and the answer
lists every failure.

Unregistering first stops new predictions, lets the running ones finish (within
``unregister_model_timeout``), then removes the node models (each drains its queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from frontend.config import ServerConfig
from frontend.errors import BadRequest, InvalidWorkflow, ServeError, WorkflowFailed
from frontend.models.loader import ModelLoader, RegisterRequest
from frontend.models.model import Model
from frontend.settings import SettingsLayer
from frontend.workflows import archive as archives
from frontend.workflows.dag import build_dag
from frontend.workflows.registry import (
    Workflow,
    WorkflowNode,
    WorkflowRegistry,
    node_model_name,
)
from frontend.workflows.spec import NodeSpec
from model_archiver import names

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
        try:
            for name in (archive.name, *(node_model_name(archive.name, node)
                                         for node in archive.spec.nodes)):
                problem = names.name_problem(name)
                if problem:
                    raise BadRequest(f"workflow {archive.name!r}: {problem}")
            dag = build_dag(archive.spec.edges)
            functions = [node.name for node in archive.spec.nodes.values() if node.is_function]
            if functions and not archive.handler:
                raise InvalidWorkflow(
                    f"the DAG's node(s) {', '.join(functions)} are not models of the spec's "
                    "'models' (no url), so they must be functions of the archive's handler "
                    "file, and the archive has none")
            self.registry.reserve(archive.name)
        except BaseException:
            archive.remove()
            raise
        try:
            nodes = await self._register_nodes(archive, response_timeout_s, startup_timeout_s,
                                               at_startup)
        except BaseException:
            self.registry.release(archive.name)
            archive.remove()
            raise
        workflow = Workflow(archive, dag, nodes)
        self.registry.add(workflow)
        logger.info("registered workflow %s (%s): nodes %s", archive.name, url,
                    ", ".join(f"{node.name} -> {node.model.name}" for node in nodes.values()))
        return workflow

    async def _register_nodes(self, archive: archives.WorkflowArchive,
                              response_timeout_s: int | None, startup_timeout_s: int | None,
                              at_startup: bool) -> dict[str, WorkflowNode]:
        specs = list(archive.spec.nodes.values())
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
        raise WorkflowFailed(f"Workflow {archive.name} has failed to register. Failures: "
                             f"[{', '.join(messages)}]")

    def _request(self, archive: archives.WorkflowArchive, spec: NodeSpec,
                 response_timeout_s: int | None, startup_timeout_s: int | None,
                 at_startup: bool) -> RegisterRequest:
        settings = spec.settings
        layer: SettingsLayer = {
            "batch_size": settings.batch_size,
            "max_batch_delay_ms": settings.max_batch_delay_ms,
            # TorchServe starts max-workers workers for a node.
            "min_workers": settings.max_workers,
            "max_workers": settings.max_workers,
        }
        if response_timeout_s is not None:
            layer["response_timeout_s"] = response_timeout_s
        if startup_timeout_s is not None:
            layer["startup_timeout_s"] = startup_timeout_s
        name = node_model_name(archive.name, spec.name)
        if spec.url is None:
            # The unpacked .war is the function's model folder (ours: no allowed_urls check).
            return RegisterRequest(url=str(archive.directory), model_name=name,
                                   handler=f"{archive.handler}:{spec.name}", settings=layer,
                                   loaded_at_startup=at_startup, given_by_operator=True,
                                   workflow=archive.name,
                                   one_request_per_call=not spec.batched)
        return RegisterRequest(url=spec.url, model_name=name, settings=layer,
                               loaded_at_startup=at_startup, given_by_operator=at_startup,
                               workflow=archive.name)

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
