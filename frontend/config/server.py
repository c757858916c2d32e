"""``ServerConfig``: the server's settings, one frozen dataclass, its fields grouped by area,
each declaring its config.properties key(s) and parser beside it (``option``); and the key
table ``build_config`` reads with, derived from those declarations."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from frontend.config.documents import ConfiguredVersion, parse_model_snapshot, parse_models_json
from frontend.config.options import Parse, key_parsers, option
from frontend.config.values import (
    KSERVE_PROTOCOLS,
    SERVICE_ENVELOPES,
    Address,
    absolute_path,
    address,
    batch_policy,
    byte_size,
    choice,
    header_name,
    metrics_mode,
    module_names,
    name_list,
    non_negative_float,
    non_negative_int,
    optional_path,
    otlp_endpoint,
    otlp_protocol,
    parse_bool,
    parse_timing_mode,
    port,
    positive_float,
    positive_int,
    regex,
    regex_list,
    tenant_weights,
    whole,
    worker_start,
)
from frontend.config.vertex import route_path
from frontend.settings import MAX_TIMEOUT_S, PolicyName
from frontend.torchserve_keys import NO_EFFECT

#: How long open requests may take to finish once the server is asked to stop: under
#: Kubernetes' default grace period (30 s) before SIGKILL.
DEFAULT_DRAIN_TIMEOUT_S = 25.0


#: The most processes ``number_of_netty_threads`` may ask for.
MAX_FRONTEND_PROCESSES = 64


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


def default_fronts(cores: int | None = None) -> int:
    """``number_of_netty_threads`` by default: one process accepting per 4 of the cores this
    process may use, from 1 to 8: a 2-core laptop keeps the one process (a second would take
    the core the workers need), a 16-core GPU host gets 4. (TorchServe's default, a Netty
    thread per logical CPU, would be a process per core here, each a Python interpreter.)"""
    return max(1, min(8, (usable_cores() if cores is None else cores) // 4))


def netty_fronts(threads: int, cores: int | None = None) -> int:
    """The processes ``number_of_netty_threads=threads`` runs: as many, up to one per 2 of the
    cores this process may use (at least 1). TorchServe's key counts threads, and its configs
    ask for many (32 in its benchmark configs, 4 in KServe's): each process here is a Python
    interpreter that needs a core of its own beside the owner, the workers and the clients.
    On 2 cores a second one gave 0.68x the echo requests/s of one (benchmarks/RESULTS.md):
    there the key runs 1. ``frontend_processes`` sets the count exactly."""
    return max(1, min(threads, (usable_cores() if cores is None else cores) // 2))


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The server's settings: each field names its config.properties key(s) and parser
    (``option``), from which ``build_config`` reads them; a field without is not a key."""

    # ---- the listeners: HTTP addresses, gRPC ports, their connections ---------------------------
    inference_address: Address = option(
        "inference_address", parse=address(80, 443), default=Address("127.0.0.1", 8080))
    management_address: Address = option(
        "management_address", parse=address(8081, 8444), default=Address("127.0.0.1", 8081))
    metrics_address: Address = option(
        "metrics_address", parse=address(8082, 8445), default=Address("127.0.0.1", 8082))
    grpc_inference_address: str = option("grpc_inference_address", parse=str, default="127.0.0.1")
    grpc_management_address: str = option("grpc_management_address", parse=str, default="127.0.0.1")
    grpc_inference_port: int = option("grpc_inference_port", parse=port, default=7070)
    grpc_management_port: int = option("grpc_management_port", parse=port, default=7071)
    enable_grpc: bool = option("enable_grpc", parse=parse_bool, default=True)
    #: How long a gRPC connection may live before the server asks it to go away (GOAWAY),
    #: and how long its open calls then have (gRPC's max_connection_age options); None: for
    #: ever, TorchServe's default.
    grpc_inference_max_connection_age_ms: int | None = option(
        "grpc_inference_max_connection_age_ms", parse=positive_int, default=None)
    grpc_management_max_connection_age_ms: int | None = option(
        "grpc_management_max_connection_age_ms", parse=positive_int, default=None)
    grpc_inference_max_connection_age_grace_ms: int | None = option(
        "grpc_inference_max_connection_age_grace_ms", parse=non_negative_int,
        default=None)
    grpc_management_max_connection_age_grace_ms: int | None = option(
        "grpc_management_max_connection_age_grace_ms", parse=non_negative_int,
        default=None)

    #: TorchServe's ``number_of_netty_threads``: how many processes accept on the inference
    #: port (this one and N-1 front processes, frontend/front/); None: ``default_fronts()``.
    number_of_netty_threads: int | None = option(
        "number_of_netty_threads", parse=whole(1, MAX_FRONTEND_PROCESSES), default=None)
    #: batchserve's own: exactly this many processes accept on the inference port, whatever
    #: the cores (``number_of_netty_threads`` is held to what they can feed: netty_fronts).
    frontend_processes_exact: int | None = option(
        "frontend_processes", parse=whole(1, MAX_FRONTEND_PROCESSES), default=None)

    # ---- TLS ------------------------------------------------------------------------------------
    # As TorchServe: an https:// address or enable_grpc_ssl=true serves the certificate
    # read from the PEM files, or from the keystore (which wins when both are given).
    certificate_file: Path | None = option(
        "certificate_file", parse=optional_path, default=None)
    private_key_file: Path | None = option(
        "private_key_file", parse=optional_path, default=None)
    keystore: Path | None = option("keystore", parse=optional_path, default=None)
    keystore_pass: str = option("keystore_pass", parse=str, default="changeit",  # TorchServe's
                                repr=False)
    keystore_type: str = option("keystore_type", parse=str, default="PKCS12")
    #: TLS on the gRPC inference and management ports, with the same certificate.
    enable_grpc_ssl: bool = option("enable_grpc_ssl", parse=parse_bool, default=False)

    # ---- models and workflows: where they are found, which start --------------------------------
    model_store: Path | None = option("model_store", parse=Path, default=None)
    #: ``load_models``: "all", "a.mar", "name=a.mar"; empty means none.
    load_models: tuple[str, ...] = option("load_models", parse=name_list, default=())
    #: Where workflow archives (.war) are found and downloaded to (TorchServe's
    #: ``workflow_store``); None: the model store, as TorchServe.
    workflow_store: Path | None = option("workflow_store", parse=optional_path,
                                         default=None)
    #: ``load_workflows``: "all", "a.war", "name=a.war"; empty means none (the key TorchServe
    #: users asked for, pytorch/serve#2615; TorchServe 0.12 has none).
    load_workflows: tuple[str, ...] = option("load_workflows", parse=name_list,
                                             default=())
    models: Mapping[str, Mapping[str, ConfiguredVersion]] = option(
        "models", parse=parse_models_json, default_factory=dict)

    # ---- workers and their time limits ----------------------------------------------------------
    #: 0 means one per GPU, or per CPU core when there is no GPU (TorchServe's rule).
    default_workers_per_model: int = option(
        "default_workers_per_model", parse=whole(0), default=0)
    #: The most workers one model version may have, and all models together (None: what
    #: the host allows, frontend/serving/capacity.py); a request beyond is refused (400).
    max_workers_per_model: int | None = option("max_workers_per_model", parse=whole(1),
                                               default=None)
    max_workers_per_server: int | None = option("max_workers_per_server", parse=whole(1),
                                                default=None)
    job_queue_size: int = option("job_queue_size", parse=whole(1), default=100)

    # ---- tenants and priorities (docs/scheduling.md) --------------------------------------------
    #: The request header (and gRPC metadata) that names a request's tenant; empty: none.
    #: Set (or tenants listed below with token authorization on), every model that is not
    #: stateful shares its queue fairly between tenants (frontend/serving/fairness.py).
    tenant_header: str = option("tenant_header", parse=header_name, default="")
    #: ``a:3,b:1``: tenants' weights (a tenant not listed, ``default`` included, weighs 1).
    #: With token authorization on, each listed tenant gets an inference key of its own in
    #: the key file (``tenants``).
    tenant_weights: tuple[tuple[str, float], ...] = option(
        "tenant_weights", parse=tenant_weights, default=())
    #: The header (and gRPC metadata) that carries a request's priority level, for models
    #: with ``priorityLevels`` (KServe v2's ``priority`` parameter too); 1 is the highest.
    priority_header: str = option("priority_header", parse=header_name, default="x-priority")
    default_response_timeout_s: int = option(
        "default_response_timeout", parse=whole(1, MAX_TIMEOUT_S), default=120)
    default_startup_timeout_s: int = option(
        "default_startup_timeout", parse=whole(1, MAX_TIMEOUT_S), default=120)
    unregister_model_timeout_s: int = option(
        "unregister_model_timeout", parse=non_negative_int, default=120)

    # ---- residency: more models than fit (docs/residency.md) -----------------------------------
    #: The most model versions loaded (with workers) at once; beyond it, the least recently
    #: used idle one is paged out when another is asked for. 0: no limit (nothing pages).
    max_loaded_models: int = option("max_loaded_models", parse=whole(0), default=0)
    #: The host memory the loaded models' weights may take together (bytes; None: no budget).
    max_loaded_memory_bytes: int | None = option("max_loaded_memory", parse=byte_size,
                                                 default=None)
    #: The memory each GPU may give the loaded models' weights (bytes; None: no budget).
    gpu_memory_budget_bytes: int | None = option("gpu_memory_budget", parse=byte_size,
                                                 default=None)

    # ---- requests and connections: sizes, counts, timeouts, CORS --------------------------------
    max_request_size_bytes: int = option(
        "max_request_size", parse=positive_int, default=6553500)
    max_response_size_bytes: int = option(
        "max_response_size", parse=positive_int, default=6553500)
    #: Batches a worker may hold at once: while one computes, the next (full) one is already
    #: there to be prepared. 1 is TorchServe's one batch per worker.
    batches_in_flight: int = option("batches_in_flight", parse=positive_int, default=2)
    #: The most inputs one request may carry: form fields, gRPC ``input`` entries, KServe v2
    #: input tensors (400 past it).
    max_request_inputs: int = option("max_request_inputs", parse=positive_int, default=1000)
    #: The most KServe v1 instances (v2 rows: first dimension) one request may carry.
    max_request_instances: int = option(
        "max_request_instances", parse=positive_int, default=10000)
    #: How long a request's head (request line and headers) may take to arrive, from its
    #: first byte (a new connection: from connecting); then 408 and the connection closes.
    request_header_timeout_s: float = option(
        "request_header_timeout", parse=positive_float, default=30.0)
    #: How long an HTTP connection may wait idle for its next request before it is closed
    #: (raise it above a load balancer's idle timeout, or the balancer may reuse a
    #: connection the server is closing).
    keep_alive_timeout_s: float = option(
        "keep_alive_timeout", parse=positive_float, default=5.0)
    #: CORS on every HTTP port (frontend/api/http/cors.py), TorchServe's keys: the allowed
    #: origin (``*``, one origin, or a comma-separated list), and the methods and headers a
    #: preflight allows. All empty: no CORS headers.
    cors_allowed_origin: str = option("cors_allowed_origin", parse=str, default="")
    cors_allowed_methods: str = option("cors_allowed_methods", parse=str, default="")
    cors_allowed_headers: str = option("cors_allowed_headers", parse=str, default="")

    # ---- placement: GPUs, CPU cores, how workers start ------------------------------------------
    #: None means every visible GPU.
    number_of_gpu: int | None = option("number_of_gpu", parse=non_negative_int, default=None)
    #: How many GPUs the host has; None: count them at start (nvidia-ml-py or /dev). Set, it
    #: places workers on GPUs that are not there (tests of placement on a CPU-only host).
    visible_gpus: int | None = None
    #: Pin each worker to its own CPU cores (CPU inference), cpu_cores_per_worker each.
    cpu_affinity: bool = option("cpu_affinity", parse=parse_bool, default=False)
    cpu_cores_per_worker: int = option("cpu_cores_per_worker", parse=positive_int, default=1)
    #: How workers start (docs/workers.md): ``fork``, from the server's fork server where the
    #: model allows it (a model with packages of its own starts fresh), or ``spawn``, a fresh
    #: interpreter each. A model's ``workerStart`` in model-config.yaml overrides it.
    worker_start: str = option("worker_start", parse=worker_start, default="fork")
    #: Modules the fork server imports when it starts, for every worker forked after
    #: (beyond those a handler is known to need): only modules that start no thread and touch
    #: no GPU when imported.
    fork_preload: tuple[str, ...] = option("fork_preload", parse=module_names,
                                           default=())

    # ---- batching: the server's defaults of model settings --------------------------------------
    default_batch_size: int = option("batch_size", parse=whole(1), default=1)
    default_max_batch_delay_ms: int = option("max_batch_delay", parse=whole(0), default=100)
    #: Server-wide default for models that name none.
    default_batch_policy: PolicyName = option(
        "batch_policy", parse=batch_policy, default=PolicyName.ADAPTIVE)

    # ---- access: the model API, tokens, where archives may come from, packages ------------------
    enable_model_api: bool = option("enable_model_api", parse=parse_bool, default=False)
    disable_token_authorization: bool = option(
        "disable_token_authorization", parse=parse_bool, default=False)
    #: What turned token authorization off, as the user wrote it (the flag, the key and its
    #: file, the variable, KServe's mode), for the start banner and the log; "" when on.
    token_authorization_off_by: str = ""
    token_expiration_min: int = option(
        "token_expiration_min", parse=positive_int, default=60)
    #: Where the token key file is written (TorchServe: key_file.json in the working folder).
    key_file: Path = option("key_file", parse=Path, default=Path("key_file.json"))
    #: Regexes an archive URL must match in full. Default: nothing outside the model store.
    allowed_urls: tuple[str, ...] = option("allowed_urls", parse=regex_list, default=())
    #: ``TS_ALLOWED_URLS`` is read from the environment only when this is true (TorchServe).
    use_env_allowed_urls: bool = option("use_env_allowed_urls", parse=parse_bool, default=False)
    #: Largest archive an http(s) registration may download.
    max_archive_size_bytes: int = option(
        "max_archive_size", parse=positive_int, default=4 * 1024**3)
    #: pip-install an archive's requirements file for its model at registration. Off by
    #: default: installing runs code from the archive (frontend/models/dependencies.py).
    install_py_dep_per_model: bool = option(
        "install_py_dep_per_model", parse=parse_bool, default=False)
    #: How long creating a model's venv or installing its requirements may take.
    install_py_dep_timeout_s: float = option(
        "install_py_dep_timeout", parse=positive_float, default=600.0)
    #: A regular expression: environment variables whose names match it in full are not
    #: passed to the workers (TorchServe's ``blacklist_env_vars``); empty: all are.
    blacklist_env_vars: str = option("blacklist_env_vars", parse=regex, default="")

    # ---- handlers: inputs, envelopes, the default handler ---------------------------------------
    limit_max_image_pixels: bool = option("limit_max_image_pixels", parse=parse_bool, default=True)
    decode_input_request: bool = option("decode_input_request", parse=parse_bool, default=True)
    #: TorchServe's request envelope for every model (kserve, kservev2, json, body).
    service_envelope: str = option(
        "service_envelope", parse=choice(SERVICE_ENVELOPES), default="")
    default_service_handler: str = option("default_service_handler", parse=str, default="")

    # ---- metrics and logs -----------------------------------------------------------------------
    enable_metrics_api: bool = option("enable_metrics_api", parse=parse_bool, default=True)
    #: KServe's documented config.properties for TorchServe says metrics_format (TorchServe
    #: itself reads only metrics_mode): the same setting.
    metrics_mode: str = option("metrics_mode", "metrics_format", parse=metrics_mode,
                               default="prometheus")
    #: TorchServe's metrics.yaml: which metrics exist, their types, units and dimensions
    #: (None: TorchServe's own, frontend/observe/metrics.yaml). A relative path is the
    #: working directory's, as TorchServe's.
    metrics_config: Path | None = option("metrics_config", parse=absolute_path, default=None)
    #: Keep handler metrics that metrics_config does not declare (TorchServe's default: drop).
    model_metrics_auto_detect: bool = option(
        "model_metrics_auto_detect", parse=parse_bool, default=False)
    disable_system_metrics: bool = option("disable_system_metrics", parse=parse_bool,
                                          default=False)
    #: Seconds between two readings of the host's metrics (CPU, memory, disk, GPUs).
    metric_time_interval_s: int = option("metric_time_interval", parse=positive_int,
                                         default=60)
    log_location: Path = option("log_location", parse=Path, default=Path("logs"))
    #: One line per request in {log_location}/access_log.log, written off the hot path, as
    #: TorchServe writes it (frontend/observe/logs.py).
    enable_access_log: bool = option("enable_access_log", parse=parse_bool, default=True)
    #: A prediction's access-log line goes on with batchserve's fields: model, version,
    #: queue_ms, batch, then its phases and its batch's reason (unless request_phases=false);
    #: false: TorchServe's line, nothing more.
    access_log_extended: bool = option("access_log_extended", parse=parse_bool, default=False)
    #: The Server-Timing header (and gRPC trailing metadata) on predictions, which reveals
    #: where their time went: off; request (a request asks with X-Server-Timing: true);
    #: always (docs/batches.md).
    server_timing: str = option("server_timing", parse=parse_timing_mode, default="off")
    #: Each prediction's time split into phases in the access log (fields after ``batch=``,
    #: with access_log_extended=true) and in ``batchserve_request_phase_seconds``; false:
    #: neither, and nothing of it is worked out per request (docs/batches.md).
    request_phases: bool = option("request_phases", parse=parse_bool, default=True)
    #: Why each batch left the queue and how full it was: ``batchserve_dispatch_total``,
    #: ``batchserve_batch_fill`` and describe's ``dispatchReasons``/``batchFill``; false:
    #: none of them is kept.
    dispatch_stats: bool = option("dispatch_stats", parse=parse_bool, default=True)

    # ---- the run directory and snapshots --------------------------------------------------------
    #: Private directory for worker sockets and extracted archives; None: a fresh temp dir.
    run_dir: Path | None = option("run_dir", parse=Path, default=None)
    snapshot_disabled: bool = option("snapshot_disabled", parse=parse_bool, default=False)
    #: TorchServe's ``model_snapshot`` JSON (KServe's config uses it): models to restore.
    model_snapshot: Mapping[str, Any] | None = option(
        "model_snapshot", parse=parse_model_snapshot, default=None)

    # ---- KServe ---------------------------------------------------------------------------------
    #: KServe's ``PROTOCOL_VERSION`` (v1, v2, grpc-v2); set, the server also answers KServe's
    #: REST on ``kserve_rest_port`` and the Open Inference gRPC service on
    #: ``kserve_grpc_port``, where KServe sends them, as TorchServe's wrapper did.
    kserve_protocol: str = option(
        "kserve_protocol", parse=choice(KSERVE_PROTOCOLS), default="")
    kserve_rest_port: int = option("kserve_rest_port", parse=port, default=8080)
    kserve_grpc_port: int = option("kserve_grpc_port", parse=port, default=8081)

    # ---- Vertex AI ------------------------------------------------------------------------------
    #: Vertex AI's ``AIP_HEALTH_ROUTE`` and ``AIP_PREDICT_ROUTE`` (frontend/config/vertex.py);
    #: set, the inference API also answers TorchServe's ``/ping`` on the one and predictions of
    #: the model ``model`` on the other, before its own routes.
    vertex_health_route: str = option("vertex_health_route", parse=route_path, default="")
    vertex_predict_route: str = option("vertex_predict_route", parse=route_path, default="")

    # ---- stopping -------------------------------------------------------------------------------
    #: Once asked to stop (SIGTERM), how long open requests may take to finish before the
    #: workers are stopped.
    drain_timeout_s: float = option(
        "drain_timeout", parse=non_negative_float, default=DEFAULT_DRAIN_TIMEOUT_S)

    # ---- OpenTelemetry traces -------------------------------------------------------------------
    #: OpenTelemetry traces of predictions (the ``otel`` extra; docs/batches.md, "Traces"):
    #: also on when the standard ``OTEL_TRACES_EXPORTER`` names ``otlp`` (``otel_env``).
    otel_traces: bool = option("otel_traces", parse=parse_bool, default=False)
    #: Where spans go: the OTLP receiver's base URL (``/v1/traces`` is added for HTTP); empty:
    #: the standard ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``, else the OTLP default.
    otel_exporter_otlp_endpoint: str = option("otel_exporter_otlp_endpoint",
                                              parse=otlp_endpoint, default="")
    #: ``http/protobuf`` or ``grpc``; empty: ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``, else
    #: ``http/protobuf``.
    otel_exporter_otlp_protocol: str = option("otel_exporter_otlp_protocol",
                                              parse=otlp_protocol, default="")

    @property
    def frontend_processes(self) -> int:
        """How many processes accept on the inference port: ``frontend_processes``, else
        ``number_of_netty_threads`` held to what the cores can feed (``netty_fronts``), else
        by default as many as the host's cores allow (``default_fronts``)."""
        if self.frontend_processes_exact is not None:
            return self.frontend_processes_exact
        if self.number_of_netty_threads is not None:
            return netty_fronts(self.number_of_netty_threads)
        return default_fronts()

    @property
    def tenants_told_apart(self) -> bool:
        """Whether requests are told apart by tenant: ``tenant_header`` or ``tenant_weights``
        is set (docs/scheduling.md)."""
        return bool(self.tenant_header or self.tenant_weights)

    @property
    def workflow_folder(self) -> Path | None:
        """Where workflow archives are looked up: ``workflow_store``, else the model store
        (TorchServe's default)."""
        return self.workflow_store if self.workflow_store is not None else self.model_store


#: config.properties key -> (ServerConfig field, parser), from the fields' own declarations.
PARSERS: dict[str, tuple[str, Parse]] = key_parsers(ServerConfig)

#: Keys read outside build_config: enable_envvars_config (load_config), and those other parts
#: read. TorchServe's keys that mean nothing here are in frontend/torchserve_keys.py.
ACCEPTED_WITHOUT_EFFECT = frozenset({
    "enable_envvars_config",
})


def known_key(key: str) -> bool:
    """Whether ``key`` is one of ours or TorchServe's (a setting, or one read elsewhere, or
    one that means nothing here), as opposed to a misspelling."""
    return key in PARSERS or key in NO_EFFECT or key in ACCEPTED_WITHOUT_EFFECT
