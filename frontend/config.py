"""One typed, frozen server configuration, parsed once at startup.

Sources, later wins: built-in defaults < ``config.properties`` < ``TS_<KEY>`` environment
variables (only when ``enable_envvars_config=true``, as TorchServe) < command-line flags.
Key names are TorchServe's, so existing ``config.properties`` files work unchanged.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import javaproperties

from frontend.errors import ConfigError
from frontend.settings import (
    FIELDS,
    INT32_MAX,
    MAX_TIMEOUT_S,
    PolicyName,
    SettingsLayer,
    Source,
    integer,
    policy,
    read_layer,
)
from frontend.torchserve_keys import NO_EFFECT

logger = logging.getLogger(__name__)

#: How long open requests may take to finish once the server is asked to stop: under
#: Kubernetes' default grace period (30 s) before SIGKILL.
DEFAULT_DRAIN_TIMEOUT_S = 25.0
#: KServe's ``PROTOCOL_VERSION`` values (``kserve_protocol``).
KSERVE_PROTOCOLS = ("v1", "v2", "grpc-v2")
#: TorchServe's envelope names (backend/codecs/envelopes.py implements them).
SERVICE_ENVELOPES = ("kserve", "kservev2", "json", "body")
#: ``worker_start``: forked by the fork server, or a fresh interpreter (spawned).
WORKER_STARTS = ("fork", "spawn")


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int
    #: ``https://``: the listener speaks TLS (certificate_file and private_key_file, or
    #: keystore: frontend/tls.py).
    is_tls: bool = False

    @classmethod
    def parse(cls, text: str, default_ports: tuple[int, int] | None = None) -> Address:
        """``http://host:port`` or ``https://host:port`` (TorchServe's address keys); without
        a port, ``default_ports`` (for http, for https) where given."""
        parts = urlsplit(text if "://" in text else f"http://{text}")
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"unsupported scheme {parts.scheme!r}")
        is_tls = parts.scheme == "https"
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"bad port in {text!r}") from exc
        if port is None and default_ports is not None and parts.hostname:
            port = default_ports[is_tls]
        if not parts.hostname or port is None:
            raise ValueError(f"expected http://host:port or https://host:port, got {text!r}")
        return cls(parts.hostname, port, is_tls)

    @property
    def endpoint(self) -> tuple[str, int]:
        """Where it listens, whatever the scheme."""
        return self.host, self.port

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.is_tls else 'http'}://{host}:{self.port}"


def _address(http_port: int, https_port: int) -> Callable[[str], Address]:
    """An address key's parser: without a port, TorchServe's default for that key and scheme
    (its Connector: inference 80/443, management 8081/8444, metrics 8082/8445)."""
    return functools.partial(Address.parse, default_ports=(http_port, https_port))


@dataclass(frozen=True, slots=True)
class ConfiguredVersion:
    """A model version's entry in the ``models=`` JSON of config.properties."""

    settings: SettingsLayer = field(default_factory=lambda: SettingsLayer())
    #: ``defaultVersion``: this version is the model's default.
    is_default_version: bool = False


#: Keys of an entry that are not settings: ``marName`` is TorchServe's bookkeeping, and so is
#: ``runtimeType`` (its snapshots write it; Python is the one runtime here).
_ENTRY_KEYS = frozenset({"marName", "defaultVersion", "runtimeType"})
_SETTING_KEYS = frozenset(setting.json for setting in FIELDS)


def parse_models_json(text: str) -> dict[str, dict[str, ConfiguredVersion]]:
    """Parse ``models={"name": {"1.0": {"batchSize": 8, ...}}}``."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError("expected a JSON object of model name -> version -> settings")
    models: dict[str, dict[str, ConfiguredVersion]] = {}
    for name, versions in raw.items():
        if not isinstance(versions, dict):
            raise ValueError(f"model {name!r}: expected an object of version -> settings")
        models[name] = {}
        for version, entry in versions.items():
            if not isinstance(entry, dict):
                raise ValueError(f"model {name!r} version {version!r}: expected an object")
            for key in sorted(set(entry) - _SETTING_KEYS - _ENTRY_KEYS):
                logger.warning("models: %s/%s: ignoring unsupported key %r", name, version, key)
            try:
                default = entry.get("defaultVersion", False)
                models[name][version] = ConfiguredVersion(
                    read_layer(entry, Source.JSON),
                    default if isinstance(default, bool) else parse_bool(str(default)))
            except ValueError as exc:
                raise ValueError(f"model {name!r} version {version!r}: {exc}") from exc
    return models


def parse_bool(text: str) -> bool:
    """TorchServe's true/false words (true, yes, 1, on; false, no, 0, off), any case."""
    lowered = text.strip().lower()
    if lowered in ("true", "yes", "1", "on"):
        return True
    if lowered in ("false", "no", "0", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _parse_non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {value}")
    return value


def _parse_positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def _whole(minimum: int, maximum: int = INT32_MAX) -> Callable[[str], int]:
    """A whole number in [``minimum``, ``maximum``]: a server default of a model setting
    within that setting's range (frontend/settings.py), a worker cap."""
    check = integer(minimum, maximum)
    return functools.partial(check, "the value")


def _parse_positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"must be a number > 0, got {text!r}")
    return value


def _parse_non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise ValueError(f"must be a number >= 0, got {text!r}")
    return value


def parse_timing_mode(text: str) -> str:
    """``server_timing``: off (also false), request (also true, on), always."""
    value = text.strip().lower()
    if value in ("", "off", "false", "no", "0"):
        return "off"
    if value in ("request", "true", "on", "yes", "1"):
        return "request"
    if value == "always":
        return "always"
    raise ValueError(f"expected off, request or always, got {text!r}")


def _parse_choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in ("", *choices):
            raise ValueError(f"expected one of {', '.join(choices)}")
        return text

    return parse


def _parse_worker_start(text: str) -> str:
    value = text.strip().lower()
    if value not in WORKER_STARTS:
        raise ValueError(f"expected one of {', '.join(WORKER_STARTS)}, got {text!r}")
    return value


def _parse_module_names(text: str) -> tuple[str, ...]:
    names = tuple(item.strip() for item in text.split(",") if item.strip())
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"not a module name: {name!r}")
    return names


def _parse_metrics_mode(text: str) -> str:
    """prometheus, log or legacy, in any case and with any spaces (as TorchServe reads it)."""
    mode = re.sub(r"\s", "", text).lower()
    if mode not in ("prometheus", "log", "legacy"):
        raise ValueError("metrics_mode is prometheus, log or legacy")
    return mode


def _parse_path(text: str) -> Path:
    """A path made absolute from the working directory (as TorchServe reads it)."""
    if not text:
        raise ValueError("expected a path")
    return Path(os.path.abspath(text))


def _parse_port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"not a port number: {value}")
    return value


def _parse_policy(text: str) -> PolicyName:
    return policy("batch_policy", text)


def _parse_json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value


def parse_model_snapshot(text: str) -> dict[str, Any]:
    """TorchServe's ``model_snapshot`` JSON, its structure checked (``check_model_snapshot``).
    Raises ValueError naming what is wrong and where."""
    document = _parse_json_object(text)
    check_model_snapshot(document)
    return document


def check_model_snapshot(document: Mapping[str, Any]) -> None:
    """A snapshot is ``{"models": {name: {version: {"marName": ..., ...}}}}``: raises
    ValueError, naming the place (``models.resnet.1.0.marName``), where it is not. The
    settings in each entry are checked when the model is restored (a bad one skips only that
    version)."""
    models = document.get("models")
    if not isinstance(models, dict):
        raise ValueError("'models' must be an object of model names")
    for name, versions in models.items():
        where = f"models.{_shown(name)}"
        if not isinstance(versions, dict) or not versions:
            raise ValueError(f"{where} must be an object of versions")
        for version, entry in versions.items():
            at = f"{where}.{_shown(version)}"
            if not isinstance(entry, dict):
                raise ValueError(f"{at} must be an object (with marName), not "
                                 f"{type(entry).__name__}")
            mar_name = entry.get("marName")
            if not isinstance(mar_name, str) or not mar_name.strip():
                raise ValueError(f"{at}.marName must name the archive")
            if not isinstance(entry.get("defaultVersion", False), bool):
                raise ValueError(f"{at}.defaultVersion must be true or false")


def _shown(text: str, limit: int = 80) -> str:
    """A value for a message: one line (repr's escapes where it needs them), cut at ``limit``
    characters."""
    shown = text if text.isprintable() else repr(text)
    return shown if len(shown) <= limit else shown[:limit] + "..."


def _parse_optional_path(text: str) -> Path | None:
    return Path(text) if text else None


def _parse_load_models(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _parse_regex_list(text: str) -> tuple[str, ...]:
    patterns = tuple(item.strip() for item in text.split(",") if item.strip())
    for pattern in patterns:
        try:
            re.compile(pattern)
        except (re.error, OverflowError, RecursionError) as exc:
            raise ValueError(f"bad regular expression {pattern!r}: {exc}") from None
    return patterns


def _parse_regex(text: str) -> str:
    try:
        re.compile(text)
    except (re.error, OverflowError, RecursionError) as exc:
        raise ValueError(f"bad regular expression {text!r}: {exc}") from None
    return text


#: ``otel_exporter_otlp_protocol``: OTLP over HTTP (protobuf bodies) or over gRPC.
OTLP_PROTOCOLS = ("http/protobuf", "grpc")


def _parse_otlp_protocol(text: str) -> str:
    if text and text not in OTLP_PROTOCOLS:
        raise ValueError(f"expected one of {', '.join(OTLP_PROTOCOLS)}")
    return text


def _parse_otlp_endpoint(text: str) -> str:
    if text and urlsplit(text).scheme not in ("http", "https"):
        raise ValueError("expected http://host:port or https://host:port")
    return text


def option(*keys: str, parse: Callable[[str], object], default: Any = MISSING,
           default_factory: Callable[[], Any] | Any = MISSING) -> Any:
    """A ServerConfig field read from config.properties ``keys`` (a later alias is the same
    setting) with ``parse``."""
    return field(default=default, default_factory=default_factory,
                 metadata={"keys": keys, "parse": parse})


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The server's settings: each field names its config.properties key(s) and parser
    (``option``), from which ``build_config`` reads them; a field without is not a key."""

    inference_address: Address = option(
        "inference_address", parse=_address(80, 443), default=Address("127.0.0.1", 8080))
    management_address: Address = option(
        "management_address", parse=_address(8081, 8444), default=Address("127.0.0.1", 8081))
    metrics_address: Address = option(
        "metrics_address", parse=_address(8082, 8445), default=Address("127.0.0.1", 8082))
    grpc_inference_address: str = option("grpc_inference_address", parse=str, default="127.0.0.1")
    grpc_management_address: str = option("grpc_management_address", parse=str, default="127.0.0.1")
    grpc_inference_port: int = option("grpc_inference_port", parse=_parse_port, default=7070)
    grpc_management_port: int = option("grpc_management_port", parse=_parse_port, default=7071)
    enable_grpc: bool = option("enable_grpc", parse=parse_bool, default=True)
    #: How long a gRPC connection may live before the server asks it to go away (GOAWAY),
    #: and how long its open calls then have (gRPC's max_connection_age options); None: for
    #: ever, TorchServe's default.
    grpc_inference_max_connection_age_ms: int | None = option(
        "grpc_inference_max_connection_age_ms", parse=_parse_positive_int, default=None)
    grpc_management_max_connection_age_ms: int | None = option(
        "grpc_management_max_connection_age_ms", parse=_parse_positive_int, default=None)
    grpc_inference_max_connection_age_grace_ms: int | None = option(
        "grpc_inference_max_connection_age_grace_ms", parse=_parse_non_negative_int,
        default=None)
    grpc_management_max_connection_age_grace_ms: int | None = option(
        "grpc_management_max_connection_age_grace_ms", parse=_parse_non_negative_int,
        default=None)
    # TLS, as TorchServe: an https:// address or enable_grpc_ssl=true serves the certificate
    # read from the PEM files, or from the keystore (which wins when both are given).
    certificate_file: Path | None = option(
        "certificate_file", parse=_parse_optional_path, default=None)
    private_key_file: Path | None = option(
        "private_key_file", parse=_parse_optional_path, default=None)
    keystore: Path | None = option("keystore", parse=_parse_optional_path, default=None)
    keystore_pass: str = field(default="changeit", repr=False,  # TorchServe's default
                               metadata={"keys": ("keystore_pass",), "parse": str})
    keystore_type: str = option("keystore_type", parse=str, default="PKCS12")
    #: TLS on the gRPC inference and management ports, with the same certificate.
    enable_grpc_ssl: bool = option("enable_grpc_ssl", parse=parse_bool, default=False)
    model_store: Path | None = option("model_store", parse=Path, default=None)
    #: ``load_models``: "all", "a.mar", "name=a.mar"; empty means none.
    load_models: tuple[str, ...] = option("load_models", parse=_parse_load_models, default=())
    #: Where workflow archives (.war) are found and downloaded to (TorchServe's
    #: ``workflow_store``); None: the model store, as TorchServe.
    workflow_store: Path | None = option("workflow_store", parse=_parse_optional_path,
                                         default=None)
    #: ``load_workflows``: "all", "a.war", "name=a.war"; empty means none (the key TorchServe
    #: users asked for, pytorch/serve#2615; TorchServe 0.12 has none).
    load_workflows: tuple[str, ...] = option("load_workflows", parse=_parse_load_models,
                                             default=())
    models: Mapping[str, Mapping[str, ConfiguredVersion]] = option(
        "models", parse=parse_models_json, default_factory=dict)
    #: 0 means one per GPU, or per CPU core when there is no GPU (TorchServe's rule).
    default_workers_per_model: int = option(
        "default_workers_per_model", parse=_whole(0), default=0)
    #: The most workers one model version may have, and all models together (None: what
    #: the host allows, frontend/serving/capacity.py); a request beyond is refused (400).
    max_workers_per_model: int | None = option("max_workers_per_model", parse=_whole(1),
                                               default=None)
    max_workers_per_server: int | None = option("max_workers_per_server", parse=_whole(1),
                                                default=None)
    job_queue_size: int = option("job_queue_size", parse=_whole(1), default=100)
    default_response_timeout_s: int = option(
        "default_response_timeout", parse=_whole(1, MAX_TIMEOUT_S), default=120)
    default_startup_timeout_s: int = option(
        "default_startup_timeout", parse=_whole(1, MAX_TIMEOUT_S), default=120)
    unregister_model_timeout_s: int = option(
        "unregister_model_timeout", parse=_parse_non_negative_int, default=120)
    max_request_size_bytes: int = option(
        "max_request_size", parse=_parse_positive_int, default=6553500)
    max_response_size_bytes: int = option(
        "max_response_size", parse=_parse_positive_int, default=6553500)
    #: Batches a worker may hold at once: while one computes, the next (full) one is already
    #: there to be prepared. 1 is TorchServe's one batch per worker.
    batches_in_flight: int = option("batches_in_flight", parse=_parse_positive_int, default=2)
    #: The most inputs one request may carry: form fields, gRPC ``input`` entries, KServe v2
    #: input tensors (400 past it).
    max_request_inputs: int = option("max_request_inputs", parse=_parse_positive_int, default=1000)
    #: The most KServe v1 instances (v2 rows: first dimension) one request may carry.
    max_request_instances: int = option(
        "max_request_instances", parse=_parse_positive_int, default=10000)
    #: How long a request's head (request line and headers) may take to arrive, from its
    #: first byte (a new connection: from connecting); then 408 and the connection closes.
    request_header_timeout_s: float = option(
        "request_header_timeout", parse=_parse_positive_float, default=30.0)
    #: How long an HTTP connection may wait idle for its next request before it is closed
    #: (raise it above a load balancer's idle timeout, or the balancer may reuse a
    #: connection the server is closing).
    keep_alive_timeout_s: float = option(
        "keep_alive_timeout", parse=_parse_positive_float, default=5.0)
    #: CORS on every HTTP port (frontend/api/http/cors.py), TorchServe's keys: the allowed
    #: origin (``*``, one origin, or a comma-separated list), and the methods and headers a
    #: preflight allows. All empty: no CORS headers.
    cors_allowed_origin: str = option("cors_allowed_origin", parse=str, default="")
    cors_allowed_methods: str = option("cors_allowed_methods", parse=str, default="")
    cors_allowed_headers: str = option("cors_allowed_headers", parse=str, default="")
    #: None means every visible GPU.
    number_of_gpu: int | None = option("number_of_gpu", parse=_parse_non_negative_int, default=None)
    #: How many GPUs the host has; None: count them at start (nvidia-ml-py or /dev). Set, it
    #: places workers on GPUs that are not there (tests of placement on a CPU-only host).
    visible_gpus: int | None = None
    #: Pin each worker to its own CPU cores (CPU inference), cpu_cores_per_worker each.
    cpu_affinity: bool = option("cpu_affinity", parse=parse_bool, default=False)
    cpu_cores_per_worker: int = option("cpu_cores_per_worker", parse=_parse_positive_int, default=1)
    #: How workers start (docs/workers.md): ``fork``, from the server's fork server where the
    #: model allows it (a model with packages of its own starts fresh), or ``spawn``, a fresh
    #: interpreter each. A model's ``workerStart`` in model-config.yaml overrides it.
    worker_start: str = option("worker_start", parse=_parse_worker_start, default="fork")
    #: Modules the fork server imports when it starts, for every worker forked after
    #: (beyond those a handler is known to need): only modules that start no thread and touch
    #: no GPU when imported.
    fork_preload: tuple[str, ...] = option("fork_preload", parse=_parse_module_names,
                                           default=())
    default_batch_size: int = option("batch_size", parse=_whole(1), default=1)
    default_max_batch_delay_ms: int = option("max_batch_delay", parse=_whole(0), default=100)
    #: Server-wide default for models that name none.
    default_batch_policy: PolicyName = option(
        "batch_policy", parse=_parse_policy, default=PolicyName.ADAPTIVE)
    enable_model_api: bool = option("enable_model_api", parse=parse_bool, default=False)
    disable_token_authorization: bool = option(
        "disable_token_authorization", parse=parse_bool, default=False)
    #: What turned token authorization off, as the user wrote it (the flag, the key and its
    #: file, the variable, KServe's mode), for the start banner and the log; "" when on.
    token_authorization_off_by: str = ""
    token_expiration_min: int = option(
        "token_expiration_min", parse=_parse_positive_int, default=60)
    #: Where the token key file is written (TorchServe: key_file.json in the working folder).
    key_file: Path = option("key_file", parse=Path, default=Path("key_file.json"))
    #: Regexes an archive URL must match in full. Default: nothing outside the model store.
    allowed_urls: tuple[str, ...] = option("allowed_urls", parse=_parse_regex_list, default=())
    #: ``TS_ALLOWED_URLS`` is read from the environment only when this is true (TorchServe).
    use_env_allowed_urls: bool = option("use_env_allowed_urls", parse=parse_bool, default=False)
    #: Largest archive an http(s) registration may download.
    max_archive_size_bytes: int = option(
        "max_archive_size", parse=_parse_positive_int, default=4 * 1024**3)
    #: pip-install an archive's requirements file for its model at registration. Off by
    #: default: installing runs code from the archive (frontend/models/dependencies.py).
    install_py_dep_per_model: bool = option(
        "install_py_dep_per_model", parse=parse_bool, default=False)
    #: How long creating a model's venv or installing its requirements may take.
    install_py_dep_timeout_s: float = option(
        "install_py_dep_timeout", parse=_parse_positive_float, default=600.0)
    #: A regular expression: environment variables whose names match it in full are not
    #: passed to the workers (TorchServe's ``blacklist_env_vars``); empty: all are.
    blacklist_env_vars: str = option("blacklist_env_vars", parse=_parse_regex, default="")
    limit_max_image_pixels: bool = option("limit_max_image_pixels", parse=parse_bool, default=True)
    decode_input_request: bool = option("decode_input_request", parse=parse_bool, default=True)
    #: TorchServe's request envelope for every model (kserve, kservev2, json, body).
    service_envelope: str = option(
        "service_envelope", parse=_parse_choice(SERVICE_ENVELOPES), default="")
    default_service_handler: str = option("default_service_handler", parse=str, default="")
    enable_metrics_api: bool = option("enable_metrics_api", parse=parse_bool, default=True)
    #: KServe's documented config.properties for TorchServe says metrics_format (TorchServe
    #: itself reads only metrics_mode): the same setting.
    metrics_mode: str = option("metrics_mode", "metrics_format", parse=_parse_metrics_mode,
                               default="prometheus")
    #: TorchServe's metrics.yaml: which metrics exist, their types, units and dimensions
    #: (None: TorchServe's own, frontend/observe/metrics.yaml). A relative path is the
    #: working directory's, as TorchServe's.
    metrics_config: Path | None = option("metrics_config", parse=_parse_path, default=None)
    #: Keep handler metrics that metrics_config does not declare (TorchServe's default: drop).
    model_metrics_auto_detect: bool = option(
        "model_metrics_auto_detect", parse=parse_bool, default=False)
    disable_system_metrics: bool = option("disable_system_metrics", parse=parse_bool,
                                          default=False)
    #: Seconds between two readings of the host's metrics (CPU, memory, disk, GPUs).
    metric_time_interval_s: int = option("metric_time_interval", parse=_parse_positive_int,
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
    #: Private directory for worker sockets and extracted archives; None: a fresh temp dir.
    run_dir: Path | None = option("run_dir", parse=Path, default=None)
    snapshot_disabled: bool = option("snapshot_disabled", parse=parse_bool, default=False)
    #: TorchServe's ``model_snapshot`` JSON (KServe's config uses it): models to restore.
    model_snapshot: Mapping[str, Any] | None = option(
        "model_snapshot", parse=parse_model_snapshot, default=None)
    #: KServe's ``PROTOCOL_VERSION`` (v1, v2, grpc-v2); set, the server also answers KServe's
    #: REST on ``kserve_rest_port`` and the Open Inference gRPC service on
    #: ``kserve_grpc_port``, where KServe sends them, as TorchServe's wrapper did.
    kserve_protocol: str = option(
        "kserve_protocol", parse=_parse_choice(KSERVE_PROTOCOLS), default="")
    kserve_rest_port: int = option("kserve_rest_port", parse=_parse_port, default=8080)
    kserve_grpc_port: int = option("kserve_grpc_port", parse=_parse_port, default=8081)
    #: Once asked to stop (SIGTERM), how long open requests may take to finish before the
    #: workers are stopped.
    drain_timeout_s: float = option(
        "drain_timeout", parse=_parse_non_negative_float, default=DEFAULT_DRAIN_TIMEOUT_S)
    #: OpenTelemetry traces of predictions (the ``otel`` extra; docs/batches.md, "Traces"):
    #: also on when the standard ``OTEL_TRACES_EXPORTER`` names ``otlp`` (``otel_env``).
    otel_traces: bool = option("otel_traces", parse=parse_bool, default=False)
    #: Where spans go: the OTLP receiver's base URL (``/v1/traces`` is added for HTTP); empty:
    #: the standard ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``, else the OTLP default.
    otel_exporter_otlp_endpoint: str = option("otel_exporter_otlp_endpoint",
                                              parse=_parse_otlp_endpoint, default="")
    #: ``http/protobuf`` or ``grpc``; empty: ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``, else
    #: ``http/protobuf``.
    otel_exporter_otlp_protocol: str = option("otel_exporter_otlp_protocol",
                                              parse=_parse_otlp_protocol, default="")

    @property
    def workflow_folder(self) -> Path | None:
        """Where workflow archives are looked up: ``workflow_store``, else the model store
        (TorchServe's default)."""
        return self.workflow_store if self.workflow_store is not None else self.model_store


#: config.properties key -> (ServerConfig field, parser), from the fields' own declarations.
_PARSERS: dict[str, tuple[str, Callable[[str], object]]] = {
    key: (item.name, item.metadata["parse"])
    for item in fields(ServerConfig) for key in item.metadata.get("keys", ())
}

#: Keys read outside build_config: enable_envvars_config (load_config), and those other parts
#: read. TorchServe's keys that mean nothing here are in frontend/torchserve_keys.py.
_ACCEPTED_WITHOUT_EFFECT = frozenset({
    "enable_envvars_config",
})

#: TorchServe's variable names that are not ``TS_`` and the key in capitals (its
#: ConfigManager reads the variable named as the constant that holds the key).
_ENV_NAMES = {"TS_TOKEN_EXPIRATION_TIME_MIN": "token_expiration_min"}


def read_properties(path: Path) -> dict[str, str]:
    """Read a Java .properties file (TorchServe's config.properties format)."""
    try:
        with path.open(encoding="utf-8") as fh:
            return dict(javaproperties.load(fh))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc


#: TorchServe's reference to an environment variable in a config value: ``$$NAME$$``.
_ENV_REFERENCE = re.compile(r"\$\$([^$]+[^$])\$\$")


def resolve_env_references(values: Mapping[str, str], environ: Mapping[str, str]
                           ) -> dict[str, str]:
    """Replace each ``$$NAME$$`` in a config file's values with that variable's value, as
    TorchServe does for every key (the SageMaker toolkit's multi-model config writes
    ``default_service_handler=$$SAGEMAKER_HANDLER$$``); a variable that is not set is an
    error, as there. A variable's value is put in as it is: never searched for references
    itself, never split into keys (``unglue_lines`` works on the file as written, before
    this), and in a JSON value never more than the string or value it stands for
    (``_resolved_json``)."""
    return {key: _resolved(key, value, environ) for key, value in values.items()}


def _resolved(key: str, value: str, environ: Mapping[str, str]) -> str:
    """``value`` (of ``key``) with its references replaced by their variables' values (in a
    JSON value, as ``_resolved_json`` puts them in)."""
    if key in _JSON_KEYS and not _ENV_REFERENCE.fullmatch(value.strip()):
        return _resolved_json(key, value, environ)
    return _ENV_REFERENCE.sub(lambda match: _variable(key, match, environ), value)


def _variable(key: str, match: re.Match[str], environ: Mapping[str, str]) -> str:
    name = match.group(1)
    if name not in environ:
        raise ConfigError(f"config key {key}: environment variable {name} (named as "
                          f"$${name}$$) is not set")
    return environ[name]


#: The keys whose value is a JSON document.
_JSON_KEYS = frozenset(("models", "model_snapshot"))


def _resolved_json(key: str, value: str, environ: Mapping[str, str]) -> str:
    """A JSON value's references resolved so that no variable changes the document's shape,
    which the file's text gives (a variable that is the whole value is the whole document):
    in a string, the variable's value is that string's text (escaped); elsewhere it must be
    one JSON value (a number, ``true``, an object...), else a ConfigError."""
    out: list[str] = []
    in_string = False
    at = copied = 0
    while at < len(value):
        char = value[at]
        match = _ENV_REFERENCE.match(value, at) if char == "$" else None
        if match is not None:
            text = _variable(key, match, environ)
            if in_string:
                text = json.dumps(text)[1:-1]
            elif not _one_json_value(text):
                raise ConfigError(f"config key {key}: environment variable {match.group(1)} "
                                  f"is not one JSON value: {_shown(repr(text), 80)}")
            out.append(value[copied:at])
            out.append(text)
            at = copied = match.end()
            continue
        if in_string and char == "\\":
            at += 2
            continue
        if char == '"':
            in_string = not in_string
        at += 1
    out.append(value[copied:])
    return "".join(out)


def _one_json_value(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _known_key(key: str) -> bool:
    return key in _PARSERS or key in NO_EFFECT or key in _ACCEPTED_WITHOUT_EFFECT


def _is_valid(key: str, text: str, environ: Mapping[str, str]) -> bool:
    """Whether ``text``, its references resolved, is a value ``key`` accepts."""
    try:
        _PARSERS[key][1](_resolved(key, text, environ).strip())
    except (ValueError, TypeError, OverflowError, RecursionError):
        return False
    return True


def unglue_lines(values: Mapping[str, str], origin: str, environ: Mapping[str, str]
                 ) -> dict[str, str]:
    """Split values that hold a second ``key=value`` glued on: a file written by appending
    lines to one that has no final newline (the SageMaker toolkit writes
    ``enable_model_api=truedefault_response_timeout=60``). A value is split only where its
    own key refuses it whole, the part before a known key is a valid value of its key, and
    that key is not set elsewhere in the file; each split is logged. (TorchServe's Java
    parsing reads such a boolean as false and loses the second key.)

    ``values`` are the file's as written, their ``$$NAME$$`` references not yet resolved
    (``environ`` resolves them only to judge a part's validity): a split falls in the file's
    own text, never inside a reference, so a variable's value is never split into keys. A
    variable that holds ``key=value`` text stays its key's value (which then refuses it)."""
    result = dict(values)
    pending = list(values.items())
    while pending:
        key, value = pending.pop()
        if key not in _PARSERS or len(value) > 4096 or _is_valid(key, value, environ):
            continue
        references = [match.span() for match in _ENV_REFERENCE.finditer(value)]
        for start in range(1, len(value)):
            if any(begin < start < end for begin, end in references):
                continue  # inside a reference: the variable's value is not the file's text
            glued, sep, rest = value[start:].partition("=")
            if not sep or not _known_key(glued) or glued in values:
                continue
            head = value[:start]
            if not _is_valid(key, head, environ):
                continue
            logger.warning("config: %s: %s=%s reads as two lines, %s=%s and %s=%s (a line "
                           "without its newline)", origin, key, _shown(value), key, head,
                           glued, _shown(rest))
            result[key] = head
            result[glued] = rest
            pending.append((glued, rest))
            break
    return result


def env_overrides(environ: Mapping[str, str], enabled: bool,
                  allowed_urls_from_env: bool = False) -> dict[str, str]:
    """``TS_<KEY>`` variables, honoured only when ``enable_envvars_config=true``; as
    TorchServe, ``TS_ALLOWED_URLS`` only with ``use_env_allowed_urls=true`` in the file too."""
    if not enabled:
        return {}
    values: dict[str, str] = {}
    for name, value in environ.items():
        if not name.startswith("TS_"):
            continue
        key = _ENV_NAMES.get(name, name[3:].lower())
        if key not in _PARSERS:
            continue
        if key == "allowed_urls" and not allowed_urls_from_env:
            logger.warning("config: TS_ALLOWED_URLS ignored: use_env_allowed_urls=true is not "
                           "in the config file (as TorchServe)")
            continue
        values[key] = value
    return values


def build_config(*sources: Mapping[str, str]) -> tuple[ServerConfig, list[str]]:
    """Merge key/value sources (later wins) into one ServerConfig.

    Returns the config and the keys it did not recognise (the caller warns about them).
    Raises ConfigError naming the key for a bad value.
    """
    values: dict[str, object] = {}
    unknown: list[str] = []
    for source in sources:
        for key, raw in source.items():
            if key not in _PARSERS:
                if key not in _ACCEPTED_WITHOUT_EFFECT and key not in NO_EFFECT:
                    unknown.append(key)
                continue
            field_name, parse = _PARSERS[key]
            try:
                values[field_name] = parse(raw.strip())
            except (ValueError, TypeError, OverflowError, RecursionError) as exc:
                raise ConfigError(f"config key {key}={_shown(repr(raw), 120)}: {exc}") from exc
    config = ServerConfig(**values)  # type: ignore[arg-type]  # types come from _PARSERS
    if config.kserve_protocol:
        _check_kserve_ports(config)
    check_tls(config)
    return config, unknown


def tls_users(config: ServerConfig) -> list[str]:
    """The settings that ask for TLS (an https:// address key, ``enable_grpc_ssl``)."""
    users = [key for key, address in _http_addresses(config).items() if address.is_tls]
    if config.enable_grpc and config.enable_grpc_ssl:
        users.append("enable_grpc_ssl")
    return users


def _http_addresses(config: ServerConfig) -> dict[str, Address]:
    addresses = {"inference_address": config.inference_address,
                 "management_address": config.management_address}
    if config.enable_metrics_api:
        addresses["metrics_address"] = config.metrics_address
    return addresses


#: keytool's command that turns a Java keystore into a PKCS12 one.
KEYTOOL_TO_PKCS12 = ("keytool -importkeystore -srckeystore {src} -srcstoretype {type} "
                     "-destkeystore {dest} -deststoretype PKCS12")


def check_tls(config: ServerConfig) -> None:
    """Where TLS is asked for, a certificate must be configured, in a form that can be read
    here; an address shared by two listeners has one scheme. Raises ConfigError naming the
    keys. (The files themselves are read at start: frontend/tls.py.)"""
    addresses = _http_addresses(config)
    by_endpoint: dict[tuple[str, int], tuple[str, Address]] = {}
    for key, address in addresses.items():
        other = by_endpoint.setdefault(address.endpoint, (key, address))
        if address.port and other[1].is_tls != address.is_tls:
            raise ConfigError(f"{other[0]}={other[1]} and {key}={address} are one listener: "
                              "give them the same scheme, or different ports")
    users = tls_users(config)
    if not users:
        return
    wanted = " and ".join(f"{key}={addresses[key]}" if key in addresses else f"{key}=true"
                          for key in users)
    if config.keystore is not None:
        kind = config.keystore_type.strip()
        if kind.upper() in ("JKS", "JCEKS"):
            converted = config.keystore.with_suffix(".p12")
            raise ConfigError(
                f"keystore_type={kind}: a Java keystore cannot be read here (no maintained "
                f"Python library reads {kind}). Convert it once with Java's keytool: "
                + KEYTOOL_TO_PKCS12.format(src=config.keystore, type=kind.upper(),
                                           dest=converted)
                + f", then set keystore={converted} and keystore_type=PKCS12 (or give "
                "certificate_file and private_key_file in PEM form)")
        if kind.upper() != "PKCS12":
            raise ConfigError(f"keystore_type={kind!r}: expected PKCS12")
        return
    given = [key for key, path in (("certificate_file", config.certificate_file),
                                   ("private_key_file", config.private_key_file))
             if path is not None]
    if len(given) == 2:
        return
    if len(given) == 1:
        missing = ({"certificate_file", "private_key_file"} - set(given)).pop()
        raise ConfigError(f"{wanted} asks for TLS and {given[0]} is set, but {missing} is "
                          f"not: give both (PEM), or a keystore (PKCS12)")
    raise ConfigError(f"{wanted} asks for TLS, but no certificate is configured: set "
                      "certificate_file and private_key_file (PEM files), or keystore, "
                      "keystore_pass and keystore_type=PKCS12")


def _check_kserve_ports(config: ServerConfig) -> None:
    """KServe's ports must not be taken by another listener (the same port is shared only
    with the listener that serves the same thing: inference REST, or gRPC inference)."""
    http_ports = {"inference_address": config.inference_address.port,
                  "management_address": config.management_address.port}
    if config.enable_metrics_api:
        http_ports["metrics_address"] = config.metrics_address.port
    grpc_port = config.kserve_grpc_port
    if config.kserve_protocol == "grpc-v2" and not config.enable_grpc:
        raise ConfigError("PROTOCOL_VERSION is grpc-v2, but enable_grpc=false turns gRPC off")
    if grpc_port and config.enable_grpc:
        for key, port in {**http_ports, "grpc_management_port": config.grpc_management_port
                          }.items():
            if port == grpc_port:
                raise ConfigError(
                    f"PROTOCOL_VERSION (kserve_protocol) is set: KServe's gRPC port {grpc_port} "
                    f"(kserve_grpc_port) is also {key}'s; move {key} (KServe's documented "
                    "config puts the inference and management APIs on 8085) or "
                    "kserve_grpc_port")
    rest_port = config.kserve_rest_port
    if rest_port:
        for key, port in {"grpc_inference_port": config.grpc_inference_port,
                          "grpc_management_port": config.grpc_management_port}.items():
            if port == rest_port:
                raise ConfigError(
                    f"PROTOCOL_VERSION (kserve_protocol) is set: KServe's REST port {rest_port} "
                    f"(kserve_rest_port) is also {key}'s; move one of them")


def load_config(
    config_file: Path | None,
    cli_overrides: Mapping[str, str],
    environ: Mapping[str, str] | None = None,
) -> ServerConfig:
    """The whole startup path: file, environment, then command-line flags."""
    environ = os.environ if environ is None else environ
    file_values: dict[str, str] = {}
    if config_file is not None:
        # Glued lines are split as the file is written, before its references are
        # resolved: a variable's value is never split into keys.
        file_values = resolve_env_references(
            unglue_lines(read_properties(config_file), str(config_file), environ), environ)
    envvars_on = _file_flag(file_values, "enable_envvars_config")
    urls_from_env = _file_flag(file_values, "use_env_allowed_urls")
    sources = [file_values, otel_env(environ),
               env_overrides(environ, envvars_on, urls_from_env),
               kserve_env(environ, envvars_on), cli_overrides]
    config, unknown = build_config(*sources)
    for key in unknown:
        logger.warning("config: unknown key %r ignored (check the spelling)", key)
    given = {key for source in sources for key in source}
    for key in sorted(given & NO_EFFECT.keys()):
        logger.info("config: %s has no effect here: %s", key, NO_EFFECT[key])
    if config.model_snapshot is not None and config.load_models and "load_models" not in \
            cli_overrides:
        # TorchServe's rule: a model_snapshot in the config is what starts, load_models is not
        # read (TorchServe's KServe sample config has both). --models still wins.
        logger.info("config: model_snapshot is given, so load_models is ignored (as TorchServe)")
        config = replace(config, load_models=())
    if config.kserve_protocol and "disable_token_authorization" not in given:
        # KServe's clients and probes send no token, and KServe authenticates at its ingress;
        # the old wrapper asked for none. Set the key to keep tokens on under KServe.
        config = replace(config, disable_token_authorization=True,
                         token_authorization_off_by="KServe's mode (PROTOCOL_VERSION); set "
                         "disable_token_authorization=false to keep tokens")
    elif config.disable_token_authorization:
        labels = [f"disable_token_authorization=true in {config_file}", "",
                  "TS_DISABLE_TOKEN_AUTHORIZATION=true", "", "--disable-token-auth"]
        setter = next(label for source, label in zip(reversed(sources), reversed(labels),
                                                     strict=True)
                      if "disable_token_authorization" in source)
        config = replace(config, token_authorization_off_by=setter)
    return config


def _file_flag(values: Mapping[str, str], key: str) -> bool:
    """A true/false key of the file read before the rest (it decides which other sources
    count); a bad value is a ConfigError naming it, as any key's."""
    raw = values.get(key, "false")
    try:
        return parse_bool(raw)
    except ValueError as exc:
        raise ConfigError(f"config key {key}={_shown(repr(raw), 120)}: {exc}") from exc


def kserve_env(environ: Mapping[str, str], enabled: bool) -> dict[str, str]:
    """KServe's ``PROTOCOL_VERSION``, which its runtime sets: read, as every variable, only
    when the config sets ``enable_envvars_config=true`` (KServe's documented config does, for
    ``TS_SERVICE_ENVELOPE``). A stray variable elsewhere must not open KServe's listeners or
    turn token authorization off."""
    protocol = environ.get("PROTOCOL_VERSION", "").strip()
    if protocol and not enabled:
        logger.warning("config: PROTOCOL_VERSION=%s ignored: enable_envvars_config is not true "
                       "(KServe's config for TorchServe sets it)", protocol)
        return {}
    if protocol and protocol not in KSERVE_PROTOCOLS:
        raise ConfigError(f"PROTOCOL_VERSION={protocol!r}: expected one of "
                          f"{', '.join(KSERVE_PROTOCOLS)}")
    return {"kserve_protocol": protocol} if protocol else {}


def otel_env(environ: Mapping[str, str]) -> dict[str, str]:
    """OpenTelemetry's own switches, which every OpenTelemetry SDK reads: traces on when
    ``OTEL_TRACES_EXPORTER`` names ``otlp``, off when it is ``none`` or ``OTEL_SDK_DISABLED``
    is true (these win over config.properties; ``TS_OTEL_TRACES`` and the command line win
    over them)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return {"otel_traces": "false"}
    exporters = {name.strip().lower()
                 for name in environ.get("OTEL_TRACES_EXPORTER", "").split(",")}
    if "otlp" in exporters:
        return {"otel_traces": "true"}
    if "none" in exporters:
        return {"otel_traces": "false"}
    return {}
