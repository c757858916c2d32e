"""Checks across keys, once the config is built: TLS asked for with a certificate that can
be read here, and KServe's ports free of the other listeners. Each raises ConfigError naming
the keys."""

from __future__ import annotations

from frontend.config.server import ServerConfig
from frontend.config.values import Address
from frontend.errors import ConfigError


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


def check_kserve_ports(config: ServerConfig) -> None:
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

