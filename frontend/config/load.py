"""The config built from its sources, later wins: built-in defaults < config.properties <
OpenTelemetry's variables < ``TS_<KEY>`` variables < KServe's ``PROTOCOL_VERSION`` < Vertex
AI's ``AIP_*`` (frontend/config/vertex.py, as the command line resolved them) < command-line
flags (``load_config``); each key read with its field's parser
(``build_config``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from frontend.config.checks import check_kserve_ports, check_tls
from frontend.config.environment import env_overrides, kserve_env, otel_env
from frontend.config.properties import read_properties, resolve_env_references, unglue_lines
from frontend.config.server import ACCEPTED_WITHOUT_EFFECT, PARSERS, ServerConfig
from frontend.config.values import parse_bool, shown
from frontend.config.vertex import VERTEX_MAX_REQUEST_SIZE
from frontend.errors import ConfigError
from frontend.torchserve_keys import NO_EFFECT

logger = logging.getLogger(__name__)


def build_config(*sources: Mapping[str, str]) -> tuple[ServerConfig, list[str]]:
    """Merge key/value sources (later wins) into one ServerConfig.

    Returns the config and the keys it did not recognise (the caller warns about them).
    Raises ConfigError naming the key for a bad value.
    """
    values: dict[str, object] = {}
    unknown: list[str] = []
    for source in sources:
        for key, raw in source.items():
            if key not in PARSERS:
                if key not in ACCEPTED_WITHOUT_EFFECT and key not in NO_EFFECT:
                    unknown.append(key)
                continue
            field_name, parse = PARSERS[key]
            try:
                values[field_name] = parse(raw.strip())
            except (ValueError, TypeError, OverflowError, RecursionError) as exc:
                raise ConfigError(f"config key {key}={shown(repr(raw), 120)}: {exc}") from exc
    config = ServerConfig(**values)  # type: ignore[arg-type]  # types come from PARSERS
    if config.kserve_protocol:
        check_kserve_ports(config)
    check_tls(config)
    if config.vertex_predict_route and config.vertex_predict_route == config.vertex_health_route:
        raise ConfigError(f"vertex_predict_route and vertex_health_route are both "
                          f"{config.vertex_predict_route!r}: they must differ")
    return config, unknown



def load_config(
    config_file: Path | None,
    cli_overrides: Mapping[str, str],
    environ: Mapping[str, str] | None = None,
    vertex: Mapping[str, str] | None = None,
) -> ServerConfig:
    """The whole startup path: file, environment, then command-line flags; ``vertex``: the
    keys Vertex AI's mode sets (``VertexEnv.overrides``), when it is on."""
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
               kserve_env(environ, envvars_on), vertex or {}, cli_overrides]
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
    elif vertex and "disable_token_authorization" not in given:
        # Vertex AI sends no TorchServe token (it authenticates its callers itself), as
        # KServe. Set the key to keep tokens on.
        config = replace(config, disable_token_authorization=True,
                         token_authorization_off_by="Vertex AI's mode (AIP_*); set "
                         "disable_token_authorization=false to keep tokens")
    elif config.disable_token_authorization:
        labels = [f"disable_token_authorization=true in {config_file}", "",
                  "TS_DISABLE_TOKEN_AUTHORIZATION=true", "", "", "--disable-token-auth"]
        setter = next(label for source, label in zip(reversed(sources), reversed(labels),
                                                     strict=True)
                      if "disable_token_authorization" in source)
        config = replace(config, token_authorization_off_by=setter)
    if vertex and "max_request_size" not in given:
        config = replace(config, max_request_size_bytes=VERTEX_MAX_REQUEST_SIZE)
    return config


def _file_flag(values: Mapping[str, str], key: str) -> bool:
    """A true/false key of the file read before the rest (it decides which other sources
    count); a bad value is a ConfigError naming it, as any key's."""
    raw = values.get(key, "false")
    try:
        return parse_bool(raw)
    except ValueError as exc:
        raise ConfigError(f"config key {key}={shown(repr(raw), 120)}: {exc}") from exc

