"""Typed reading of TorchServe's string parameters (REST query strings, gRPC fields), each
checked against its range where it enters: a value out of range is a 400 that names the
parameter and the range, never a number that fails later where it is stored."""

from __future__ import annotations

from frontend.errors import BadRequest, quoted
from frontend.settings import INT32_MAX, integer

INT32_MIN = -INT32_MAX - 1


def int_param(params: dict[str, str], name: str, default: int, minimum: int = INT32_MIN,
              maximum: int = INT32_MAX) -> int:
    """Parameter ``name``, a whole number in [``minimum``, ``maximum``] (by default what the
    gRPC API's int32 fields hold); ``default`` when absent or empty."""
    if name not in params or params[name] == "":
        return default
    try:
        value: int = integer(minimum, maximum)(f"parameter {name}", params[name])
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return value


def bool_param(params: dict[str, str], name: str, default: bool) -> bool:
    if name not in params:
        return default
    value = params[name].strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise BadRequest(f"parameter {name} must be true or false, got {quoted(params[name])}")
