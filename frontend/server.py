"""The server: assembles registry, workers and listeners; runs until asked to stop.

Order: bind every port first (a busy port fails the start at once), load the startup models,
then serve. Stopping runs in reverse: stop accepting and let open requests finish (the
workers are still up to answer them), then stop the workers, then remove the run directory,
all within ``drain_timeout`` (under Kubernetes' grace period before SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from frontend.api.grpc.servers import GrpcServers
from frontend.api.http.app import HttpListeners, serve_http
from frontend.api.http.linked import LinkedPredictions
from frontend.config import Address, ServerConfig, usable_cores
from frontend.errors import ConfigError, ServeError
from frontend.front.owner import Fronts
from frontend.models.loader import ModelLoader, RegisterRequest
from frontend.models.registry import ModelRegistry
from frontend.models.residency import residency_limits
from frontend.models.snapshot import Snapshots, restore_requests
from frontend.models.startup import model_store_lister, startup_entries
from frontend.observe.dashboard import BusyTime, Dashboard
from frontend.observe.events import Observers
from frontend.observe.logs import AccessLog, ServerLogs
from frontend.observe.metric_specs import load_metrics_config
from frontend.observe.metrics import ServerMetrics
from frontend.observe.status import ModelStatus, Statuses
from frontend.ops.auth import TokenAuthority
from frontend.ops.plane import InferencePlane
from frontend.ops.services import Services
from frontend.ops.tenants import Tenancy
from frontend.serving.capacity import HostLimits, worker_caps
from frontend.serving.forkserver import Launch
from frontend.serving.placement import CpuAssigner, GpuAssigner, Placement
from frontend.serving.workers import start_failures
from frontend.tls import ServerCertificate, load_certificate
from frontend.workflows import archive as workflow_archives
from frontend.workflows.loader import WorkflowLoader
from frontend.workflows.registry import WorkflowRegistry

if TYPE_CHECKING:  # imported only when tracing is on (start_tracing)
    from frontend.observe.tracing import Tracing

logger = logging.getLogger(__name__)

#: Workers get at least this long to exit cleanly at the end of a drain.
WORKER_EXIT_S = 1.0


@dataclass(frozen=True, slots=True)
class BoundAddresses:
    """The addresses the listeners really bound (port 0 becomes a real port)."""

    inference: Address
    management: Address
    metrics: Address | None
    grpc_inference_port: int | None = None
    grpc_management_port: int | None = None
    #: Under KServe (PROTOCOL_VERSION): where its REST and gRPC traffic is answered.
    kserve_rest: Address | None = None
    kserve_grpc_port: int | None = None


def startup_requests(config: ServerConfig, entries: tuple[str, ...]) -> list[RegisterRequest]:
    """Turn ``load_models`` / ``--models`` entries (``all``, ``x.mar``, ``name=x.mar``)
    into registrations."""
    return [RegisterRequest(url=url, model_name=name, loaded_at_startup=True,
                            given_by_operator=True)
            for name, url in startup_entries(entries, "load_models",
                                             model_store_lister(config))]


def startup_workflows(config: ServerConfig, entries: tuple[str, ...]
                      ) -> list[tuple[str | None, str]]:
    """Turn ``load_workflows`` / ``--workflows`` entries (``all``, ``x.war``, ``name=x.war``)
    into (name or None, url) pairs."""

    def store() -> Iterable[Path]:
        if config.workflow_folder is None:
            raise ConfigError("load_workflows=all needs a workflow store (--workflow-store "
                              "or --model-store)")
        return workflow_archives.list_store(config.workflow_folder)

    return startup_entries(entries, "load_workflows", store)


def statuses(registry: ModelRegistry) -> Statuses:
    """What the observers read of the registered model versions now, when they look."""

    def now() -> Iterable[ModelStatus]:
        return [model.status() for model in registry]

    return now


def server_metrics(config: ServerConfig, models: Statuses, gpu_count: int,
                   named_loggers: bool = False) -> ServerMetrics:
    """The server's metrics, as its configuration says. Their log files go where TorchServe
    puts them: ``$METRICS_LOCATION`` when set (as TorchServe's log4j configuration), else the
    log location; with ``named_loggers``, where the log4j2 configuration given says."""
    location = os.environ.get("METRICS_LOCATION", "").strip()
    return ServerMetrics(
        models, mode=config.metrics_mode, config=load_metrics_config(config.metrics_config),
        auto_detect=config.model_metrics_auto_detect,
        log_dir=Path(location) if location else config.log_location,
        system_metrics=not config.disable_system_metrics, gpu_count=gpu_count,
        interval_s=config.metric_time_interval_s, named_loggers=named_loggers,
        phases=config.request_phases, dispatch_stats=config.dispatch_stats,
        tenants=config.tenants_told_apart,
        residency=residency_limits(config).on)


def start_tracing(config: ServerConfig) -> Tracing:
    """The server's OpenTelemetry tracing (``otel_traces``): only here, and only when it is
    on, is OpenTelemetry imported."""
    try:
        from frontend.observe.tracing import start_tracing as start
    except ImportError as exc:
        raise ConfigError(f"otel_traces=true (or OTEL_TRACES_EXPORTER=otlp) needs the otel "
                          f"extra: pip install 'batchserve[otel]' ({exc})") from None
    return start(config, os.environ)


def observers(metrics: ServerMetrics, access: AccessLog | None, busy: BusyTime | None,
              tracing: Tracing | None) -> Observers:
    """Who is told what the serving core does (frontend/observe/events.py): the metrics (the
    phases, reasons and fill only as the configuration keeps them), the access log when there
    is one, the live page's busy time, and the traces when they are on. What nobody is
    subscribed to costs nothing where it happens."""
    subscribed = Observers()
    metrics.subscribe(subscribed)
    if access is not None:
        subscribed.call_ended.append(access.call_ended)
    if busy is not None:
        subscribed.batch_ended.append(busy.batch_ended)
    if tracing is not None:
        tracing.subscribe(subscribed)
    return subscribed


class Server:
    def __init__(self, config: ServerConfig,
                 on_started: Callable[[Server], None] | None = None, *,
                 named_loggers: bool = False, forkserver: Launch | None = None) -> None:
        self.config = config
        #: A fork server started before this server (``early_forkserver``), for its loader.
        self._forkserver = forkserver
        #: The access, model and metric logs go to the Python loggers of TorchServe's names
        #: (ACCESS_LOG, ...), which a log4j2 --log-config set up, not to log_location.
        self.named_loggers = named_loggers
        self.bound: BoundAddresses | None = None
        self.services: Services | None = None
        self._stop: asyncio.Event | None = None
        #: Called (on the server's loop) once every listener is serving.
        self._on_started = on_started
        self._loop: asyncio.AbstractEventLoop | None = None
        #: time.monotonic() by which draining must be done, once stopping.
        self._drain_deadline: float | None = None
        #: The HTTPS listeners' TLS context (an https:// address), made at start.
        self._tls: ssl.SSLContext | None = None
        self._certificate: ServerCertificate | None = None
        #: The front processes (number_of_netty_threads > 1), while serving.
        self.fronts: Fronts | None = None

    def request_stop(self) -> None:
        """Ask the server to stop; safe to call from any thread."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)

    def _make_run_dir(self) -> tuple[Path, bool]:
        if self.config.run_dir is not None:
            self.config.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            return self.config.run_dir, False
        # Short path under /tmp: Unix socket paths are limited to about 100 bytes.
        return Path(tempfile.mkdtemp(prefix="batchserve-", dir="/tmp")), True

    async def serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        config = self.config
        # Read before anything else: a certificate that cannot be used stops the start here.
        certificate = load_certificate(config)
        https = any(address.is_tls for address in (
            config.inference_address, config.management_address, config.metrics_address))
        self._tls = certificate.ssl_context() if certificate is not None and https else None
        self._certificate = certificate
        tracing = start_tracing(config) if config.otel_traces else None
        run_dir, owns_run_dir = self._make_run_dir()
        run_dir.chmod(0o700)
        registry = ModelRegistry()
        gpus = GpuAssigner.detect(config.number_of_gpu, config.visible_gpus)
        metrics = server_metrics(config, statuses(registry), gpus.count, self.named_loggers)
        cpus = CpuAssigner.detect(config.cpu_cores_per_worker) if config.cpu_affinity else None
        logs = ServerLogs(config.log_location, config.enable_access_log, self.named_loggers,
                          phases=config.request_phases, extended=config.access_log_extended)
        busy = BusyTime()
        subscribed = observers(metrics, logs.access if config.enable_access_log else None,
                               busy, tracing)
        placement = Placement(gpus, cpus, registry.worker_count)
        caps = placement.caps = worker_caps(config, HostLimits.detect(placement.cores,
                                                                      gpus.count))
        loader = ModelLoader(config, run_dir, registry, placement, subscribed, logs.model,
                             forkserver=self._forkserver)
        auth = None
        if not config.disable_token_authorization:
            auth = TokenAuthority(config.key_file, config.token_expiration_min,
                                  tenants=[name for name, _ in config.tenant_weights])
        snapshots = Snapshots(config.log_location / "config", not config.snapshot_disabled)
        plane = InferencePlane(registry, subscribed, logs.access, config.server_timing,
                               Tenancy(config.tenant_header, config.priority_header, auth,
                                       [name for name, _ in config.tenant_weights]))
        workflows = WorkflowLoader(config, loader, WorkflowRegistry(), run_dir / "workflows")
        dashboard = Dashboard(statuses(registry), metrics, busy=busy, gpu_count=gpus.count)
        metrics.front_requests = self._front_requests
        self.services = Services(config, registry, loader, metrics, auth, snapshots, plane,
                                 workflows, dashboard)
        grpc_servers = GrpcServers(
            self.services, certificate if config.enable_grpc_ssl else None,
            run_dir if config.frontend_processes > 1 else None) if config.enable_grpc else None
        if grpc_servers is not None:
            front_calls = grpc_servers.front_calls.counts
            metrics.front_grpc_requests = lambda: dict(front_calls)
        with logs:
            logger.info("workers: %s", caps.basis)
            await metrics.start()
            dashboard.start()
            try:
                await self._serve(http_services=self.services, loader=loader,
                                  snapshots=snapshots, auth=auth, grpc_servers=grpc_servers,
                                  workflows=workflows)
            finally:
                if grpc_servers is not None:
                    await grpc_servers.stop(grace_s=0)
                await workflows.close()
                await loader.close(drain_timeout_s=self._drain_left())
                await dashboard.close()
                await metrics.close()
                if tracing is not None:  # what is left is exported, off the event loop
                    await asyncio.to_thread(tracing.close)
                if auth is not None:
                    auth.remove()
                if owns_run_dir:
                    shutil.rmtree(run_dir, ignore_errors=True)
                elif config.frontend_processes > 1:
                    Fronts.inner_path(run_dir).unlink(missing_ok=True)
                else:
                    shutil.rmtree(loader.archive_dir, ignore_errors=True)
                logger.info("stopped")

    async def _serve(self, http_services: Services, loader: ModelLoader,
                     snapshots: Snapshots, auth: TokenAuthority | None,
                     grpc_servers: GrpcServers | None, workflows: WorkflowLoader) -> None:
        """Bind, load the startup models, serve until asked to stop, stop accepting."""
        assert self._stop is not None
        run_dir = loader.run_dir
        inner = Fronts.inner_path(run_dir) if self.config.frontend_processes > 1 else None
        async with serve_http(http_services, self._tls, inner) as http, \
                self._fronts(http, http_services, run_dir) as fronts:
            bound = http.bound
            await self._load_startup_models(loader, snapshots)
            await self._load_startup_workflows(workflows)
            grpc_ports: dict[str, int] = {}
            if grpc_servers is not None:
                await grpc_servers.start()
                grpc_ports = grpc_servers.ports
            kserve = self.config.kserve_protocol
            self.bound = BoundAddresses(
                bound["inference"], bound["management"], bound.get("metrics"),
                grpc_ports.get("inference"), grpc_ports.get("management"),
                bound.get("kserve", bound["inference"]) if kserve else None,
                grpc_ports.get("kserve", grpc_ports.get("inference")) if kserve else None)
            if auth is not None:
                auth.start()
                logger.info("token authorization is on: keys in %s", auth.path.resolve())
            else:
                logger.warning("token authorization is disabled (by %s): anyone who can "
                               "reach the ports can use every API",
                               self.config.token_authorization_off_by or "the configuration")
            await http.start()
            if fronts is not None:
                if grpc_servers is not None:  # the gRPC ports they share, once bound
                    fronts.share_grpc(grpc_servers.shared)
                await fronts.start()
            logger.info("inference API on %s, management API on %s, metrics on %s, gRPC "
                        "inference/management ports %s/%s", bound["inference"],
                        bound["management"], bound.get("metrics"),
                        grpc_ports.get("inference"), grpc_ports.get("management"))
            if kserve:
                logger.info("KServe (PROTOCOL_VERSION=%s): REST on %s, gRPC (Open Inference) on "
                            "port %s; models %s", kserve, self.bound.kserve_rest,
                            self.bound.kserve_grpc_port, ", ".join(loader.registry.names()))
            if self._on_started is not None:
                self._on_started(self)
            await self._stop.wait()
            drain_s = self.config.drain_timeout_s
            self._drain_deadline = time.monotonic() + drain_s
            logger.info("stopping: no new connections; open requests have %g s to finish "
                        "(drain_timeout)", drain_s)
            # The fronts first (they stop accepting, and finish their open requests, which
            # this process answers), the listeners of this process at once.
            await asyncio.gather(http.stop(), *(
                # (The inner gRPC servers stay until the fronts' relayed calls are answered.)
                [grpc_servers.stop(grace_s=drain_s, inner=False)]
                if grpc_servers is not None else []), *(
                [fronts.stop(drain_s)] if fronts is not None else []))

    def _front_requests(self) -> dict[int, int]:
        return self.fronts.requests() if self.fronts is not None else {}

    @contextlib.asynccontextmanager
    async def _fronts(self, http: HttpListeners, services: Services, run_dir: Path
                      ) -> AsyncIterator[Fronts | None]:
        """The front processes (``number_of_netty_threads`` > 1; started by ``_serve`` once
        this process serves), closed when the block ends, however it ends."""
        config = self.config
        count = config.frontend_processes
        asked = config.number_of_netty_threads
        if config.frontend_processes_exact is None and asked is not None and count < asked:
            logger.info("number_of_netty_threads=%d: %d process(es) accept on the inference "
                        "port, at most one per 2 of the %d cores this server may use "
                        "(frontend_processes sets the count exactly; docs/frontends.md)",
                        asked, count, usable_cores())
        if count < 2:
            yield None
            return
        shared = http.shared()
        certificate = self._certificate
        settings = {
            "inner": str(Fronts.inner_path(run_dir)),
            "listeners": [[apis, str(address)] for apis, address in shared],
            "kserve": bool(config.kserve_protocol),
            "header_timeout_s": config.request_header_timeout_s,
            "keep_alive_s": config.keep_alive_timeout_s,
            "drain_timeout_s": config.drain_timeout_s,
            "max_body_bytes": config.max_request_size_bytes,
            "certificate": {"key": certificate.key_pem.decode("latin-1"),
                            "chain": certificate.chain_pem.decode("latin-1"),
                            "source": certificate.source}
            if certificate is not None and (any(a.is_tls for _, a in shared) or (
                config.enable_grpc and config.enable_grpc_ssl)) else None}

        def served() -> LinkedPredictions:
            assert http.linked is not None, "the inference listener serves first"
            predictions, table = http.linked
            return LinkedPredictions(predictions, table, services.metrics.count_response,
                                     http.cors)

        fronts = self.fronts = Fronts(count, run_dir, settings, served)
        try:
            yield fronts
        finally:
            await fronts.close()
            self.fronts = None

    def _drain_left(self) -> float:
        """What is left of drain_timeout for the workers (a little at least, to exit cleanly)."""
        if self._drain_deadline is None:
            return self.config.drain_timeout_s
        return max(WORKER_EXIT_S, self._drain_deadline - time.monotonic())

    async def _load_startup_workflows(self, workflows: WorkflowLoader) -> None:
        """Load ``load_workflows`` / ``--workflows`` (after the models); one that fails is
        logged, as a startup model is."""
        for name, url in startup_workflows(self.config, self.config.load_workflows):
            try:
                await workflows.register(url, name, at_startup=True)
            except ServeError as exc:
                logger.error("cannot load startup workflow %s: %s", url, exc)

    async def _load_startup_models(self, loader: ModelLoader, snapshots: Snapshots) -> None:
        """Load ``load_models`` / ``--models``; without them, restore the latest snapshot."""
        defaults: dict[str, str] = {}
        if self.config.load_models:
            requests = startup_requests(self.config, self.config.load_models)
        else:
            document = self.config.model_snapshot or (
                snapshots.latest() if snapshots.enabled else None)
            requests, defaults = restore_requests(document) if document else ([], {})
            if requests:
                logger.info("restoring %d model(s) from the last snapshot", len(requests))
        models = []
        for request in requests:
            try:
                models.append(await loader.register(replace(request, synchronous=False)))
                if self.config.load_models:  # TorchServe's startupModels: not a snapshot's
                    loader.registry.startup_models.add(models[-1].name)
            except ServeError as exc:
                logger.error("cannot load startup model %s: %s", request.url, exc)
                if request.model_name:
                    loader.registry.failed_at_startup.add(request.model_name)
        for name, version in defaults.items():
            with contextlib.suppress(ServeError):
                loader.registry.set_default(name, version)
        for failure in await start_failures(w for model in models for w in model.workers):
            logger.error("startup model failed to load: %s", failure)
        if loader.forkserver is not None:
            loader.forkserver.drop_unused_launch()
