"""The environment's part in the config: TorchServe's ``TS_<KEY>`` variables (only with
``enable_envvars_config=true``), KServe's ``PROTOCOL_VERSION``, OpenTelemetry's switches."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from frontend.config.server import PARSERS
from frontend.config.values import KSERVE_PROTOCOLS
from frontend.errors import ConfigError

logger = logging.getLogger(__name__)

#: TorchServe's variable names that are not ``TS_`` and the key in capitals (its
#: ConfigManager reads the variable named as the constant that holds the key).
_ENV_NAMES = {"TS_TOKEN_EXPIRATION_TIME_MIN": "token_expiration_min"}


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
        if key not in PARSERS:
            continue
        if key == "allowed_urls" and not allowed_urls_from_env:
            logger.warning("config: TS_ALLOWED_URLS ignored: use_env_allowed_urls=true is not "
                           "in the config file (as TorchServe)")
            continue
        values[key] = value
    return values



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
