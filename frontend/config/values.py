"""How one config.properties value is read: the parsers the ``ServerConfig`` fields name
(``option(..., parse=...)``), and the listener ``Address``.

Each parser takes the value's text (stripped) and returns the field's value, or raises
ValueError saying what is wrong; ``build_config`` names the key.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from frontend.settings import INT32_MAX, PolicyName, integer, policy

#: KServe's ``PROTOCOL_VERSION`` values (``kserve_protocol``).
KSERVE_PROTOCOLS = ("v1", "v2", "grpc-v2")
#: TorchServe's envelope names (backend/codecs/envelopes.py implements them).
SERVICE_ENVELOPES = ("kserve", "kservev2", "json", "body")
#: ``worker_start``: forked by the fork server, or a fresh interpreter (spawned).
WORKER_STARTS = ("fork", "spawn")
#: ``otel_exporter_otlp_protocol``: OTLP over HTTP (protobuf bodies) or over gRPC.
OTLP_PROTOCOLS = ("http/protobuf", "grpc")


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


def address(http_port: int, https_port: int) -> Callable[[str], Address]:
    """An address key's parser: without a port, TorchServe's default for that key and scheme
    (its Connector: inference 80/443, management 8081/8444, metrics 8082/8445)."""
    return functools.partial(Address.parse, default_ports=(http_port, https_port))


def shown(text: str, limit: int = 80) -> str:
    """A value for a message: one line (repr's escapes where it needs them), cut at ``limit``
    characters."""
    text_shown = text if text.isprintable() else repr(text)
    return text_shown if len(text_shown) <= limit else text_shown[:limit] + "..."


def parse_bool(text: str) -> bool:
    """TorchServe's true/false words (true, yes, 1, on; false, no, 0, off), any case."""
    lowered = text.strip().lower()
    if lowered in ("true", "yes", "1", "on"):
        return True
    if lowered in ("false", "no", "0", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def whole(minimum: int, maximum: int = INT32_MAX) -> Callable[[str], int]:
    """A whole number in [``minimum``, ``maximum``]: a server default of a model setting
    within that setting's range (frontend/settings.py), a worker cap."""
    check = integer(minimum, maximum)
    return functools.partial(check, "the value")


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"must be a number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise ValueError(f"must be a number >= 0, got {text!r}")
    return value


#: The units of a size in bytes (``max_loaded_memory``, ``gpu_memory_budget``): decimal and
#: binary, any case; none is bytes.
BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4, "kib": 1024,
              "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)")


def byte_size(text: str) -> int | None:
    """A size in bytes (``8GiB``, ``500MB``, ``1048576``: BYTE_UNITS), > 0; empty: None (no
    budget)."""
    if not text.strip():
        return None
    match = _SIZE.fullmatch(text.strip().lower())
    if match is None or match.group(2) not in BYTE_UNITS:
        raise ValueError(f"expected a size in bytes such as 8GiB, 500MB or 1048576, got "
                         f"{shown(text)!r}")
    size = int(float(match.group(1)) * BYTE_UNITS[match.group(2)])
    if size < 1:
        raise ValueError(f"must be at least 1 byte, got {shown(text)!r}")
    return size


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


def choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    """One of ``choices``, or empty."""

    def parse(text: str) -> str:
        if text not in ("", *choices):
            raise ValueError(f"expected one of {', '.join(choices)}")
        return text

    return parse


def worker_start(text: str) -> str:
    value = text.strip().lower()
    if value not in WORKER_STARTS:
        raise ValueError(f"expected one of {', '.join(WORKER_STARTS)}, got {text!r}")
    return value


def module_names(text: str) -> tuple[str, ...]:
    names = tuple(item.strip() for item in text.split(",") if item.strip())
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"not a module name: {name!r}")
    return names


def metrics_mode(text: str) -> str:
    """prometheus, log or legacy, in any case and with any spaces (as TorchServe reads it)."""
    mode = re.sub(r"\s", "", text).lower()
    if mode not in ("prometheus", "log", "legacy"):
        raise ValueError("metrics_mode is prometheus, log or legacy")
    return mode


def absolute_path(text: str) -> Path:
    """A path made absolute from the working directory (as TorchServe reads it)."""
    if not text:
        raise ValueError("expected a path")
    return Path(os.path.abspath(text))


def optional_path(text: str) -> Path | None:
    return Path(text) if text else None


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"not a port number: {value}")
    return value


def batch_policy(text: str) -> PolicyName:
    return policy("batch_policy", text)


def name_list(text: str) -> tuple[str, ...]:
    """A comma-separated list (``load_models``, ``load_workflows``), its blanks dropped."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def regex_list(text: str) -> tuple[str, ...]:
    patterns = name_list(text)
    for pattern in patterns:
        regex(pattern)
    return patterns


def regex(text: str) -> str:
    try:
        re.compile(text)
    except (re.error, OverflowError, RecursionError) as exc:
        raise ValueError(f"bad regular expression {text!r}: {exc}") from None
    return text


def otlp_protocol(text: str) -> str:
    if text and text not in OTLP_PROTOCOLS:
        raise ValueError(f"expected one of {', '.join(OTLP_PROTOCOLS)}")
    return text


def otlp_endpoint(text: str) -> str:
    if text and urlsplit(text).scheme not in ("http", "https"):
        raise ValueError("expected http://host:port or https://host:port")
    return text


#: A tenant's name: what a header or the key file may name (it labels metrics).
TENANT_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
#: The largest weight a tenant may have (weights are relative: 1 to 1000 covers any split).
MAX_TENANT_WEIGHT = 1000.0


def tenant_weights(text: str) -> tuple[tuple[str, float], ...]:
    """``tenant_weights``: ``a:3,b:1`` (name:weight, weight a number > 0 and at most 1000; a
    name alone weighs 1), each tenant once."""
    weights: dict[str, float] = {}
    for item in name_list(text):
        name, _, raw = item.partition(":")
        name = name.strip()
        if not TENANT_NAME.fullmatch(name):
            raise ValueError(f"tenant name {shown(name)!r} must be 1 to 64 letters, digits, "
                             "'_', '-' or '.'")
        try:
            weight = float(raw) if raw.strip() else 1.0
        except ValueError:
            raise ValueError(f"weight of tenant {name} must be a number, got {shown(raw)!r}"
                             ) from None
        if not 0 < weight <= MAX_TENANT_WEIGHT:
            raise ValueError(f"weight of tenant {name} must be > 0 and <= "
                             f"{MAX_TENANT_WEIGHT:g}, got {shown(raw)}")
        if name in weights:
            raise ValueError(f"tenant {name} is listed twice")
        weights[name] = weight
    return tuple(weights.items())


def header_name(text: str) -> str:
    """An HTTP header's name (also gRPC metadata's), kept lower-case; empty: none."""
    if text and not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", text):
        raise ValueError(f"{shown(text)!r} is not an HTTP header name")
    return text.lower()
