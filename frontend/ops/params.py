"""Typed reading of TorchServe's string parameters (REST query strings, gRPC fields)."""

from __future__ import annotations

from frontend.errors import BadRequest, quoted


def int_param(params: dict[str, str], name: str, default: int) -> int:
    if name not in params or params[name] == "":
        return default
    try:
        return int(params[name])
    except ValueError:
        raise BadRequest(f"parameter {name} must be an integer, got {quoted(params[name])}"
                         ) from None


def bool_param(params: dict[str, str], name: str, default: bool) -> bool:
    if name not in params:
        return default
    value = params[name].strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise BadRequest(f"parameter {name} must be true or false, got {quoted(params[name])}")
