"""One typed, frozen server configuration, parsed once at startup.

Sources, later wins: built-in defaults < ``config.properties`` < ``TS_<KEY>`` environment
variables (only when ``enable_envvars_config=true``, as TorchServe) < command-line flags.
Key names are TorchServe's, so existing ``config.properties`` files work unchanged.

By area (every name is imported from here):

- ``values``: how one value is read (the parsers fields name, ``Address``, ``parse_bool``);
- ``documents``: the keys whose value is JSON (``models``, ``model_snapshot``);
- ``options``: how a field declares its key(s) and parser (``option``), the key table;
- ``server``: ``ServerConfig``, its fields grouped by area, each with its ``option``;
- ``properties``: reading config.properties (``$$NAME$$`` references, glued lines);
- ``environment``: ``TS_<KEY>`` variables, KServe's ``PROTOCOL_VERSION``, OpenTelemetry's;
- ``vertex``: Vertex AI's ``AIP_*`` variables (the prebuilt PyTorch image's contract);
- ``checks``: TLS and KServe's ports, across keys;
- ``load``: ``build_config`` and the whole startup path, ``load_config``.
"""

from __future__ import annotations

from frontend.config.checks import KEYTOOL_TO_PKCS12, check_kserve_ports, check_tls, tls_users
from frontend.config.documents import (
    ConfiguredVersion,
    check_model_snapshot,
    parse_model_snapshot,
    parse_models_json,
)
from frontend.config.environment import env_overrides, kserve_env, otel_env
from frontend.config.load import build_config, load_config
from frontend.config.options import option
from frontend.config.properties import read_properties, resolve_env_references, unglue_lines
from frontend.config.server import (
    ACCEPTED_WITHOUT_EFFECT,
    DEFAULT_DRAIN_TIMEOUT_S,
    MAX_FRONTEND_PROCESSES,
    PARSERS,
    ServerConfig,
    default_fronts,
    known_key,
    netty_fronts,
    usable_cores,
)
from frontend.config.values import (
    KSERVE_PROTOCOLS,
    OTLP_PROTOCOLS,
    SERVICE_ENVELOPES,
    WORKER_STARTS,
    Address,
    parse_bool,
    parse_timing_mode,
)

__all__ = [
    "ACCEPTED_WITHOUT_EFFECT",
    "DEFAULT_DRAIN_TIMEOUT_S",
    "KEYTOOL_TO_PKCS12",
    "KSERVE_PROTOCOLS",
    "MAX_FRONTEND_PROCESSES",
    "OTLP_PROTOCOLS",
    "PARSERS",
    "SERVICE_ENVELOPES",
    "WORKER_STARTS",
    "Address",
    "ConfiguredVersion",
    "ServerConfig",
    "build_config",
    "check_kserve_ports",
    "check_model_snapshot",
    "check_tls",
    "default_fronts",
    "env_overrides",
    "known_key",
    "kserve_env",
    "load_config",
    "netty_fronts",
    "option",
    "otel_env",
    "parse_bool",
    "parse_model_snapshot",
    "parse_models_json",
    "parse_timing_mode",
    "read_properties",
    "resolve_env_references",
    "tls_users",
    "unglue_lines",
    "usable_cores",
]
