"""Token authorization as TorchServe 0.11+: a key file with three keys, Bearer headers.

At start the server writes ``key_file.json`` (mode 0600) holding an inference key, a
management key (both expire after ``token_expiration_min``) and an API key that rotates
the other two through ``GET /token?type=inference|management`` on the management port.
With tenants listed in ``tenant_weights`` it also holds an inference key for each tenant
(``"tenants": {"a": {"key": ...}}``, which never expire, as the API key): a request that
carries one is authorized as an inference request of that tenant (docs/scheduling.md).
"""

from __future__ import annotations

import enum
import hmac
import json
import os
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from frontend.errors import BadRequest, Unauthorized


class KeyKind(enum.Enum):
    INFERENCE = "inference"
    MANAGEMENT = "management"
    API = "API"


@dataclass(slots=True)
class _Key:
    value: str
    expires_at: float | None  # time.time(); None: never (the API key)


def _timestamp(seconds: float) -> str:
    moment = datetime.fromtimestamp(seconds, tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class TokenAuthority:
    """Holds the current keys, checks requests against them, and keeps the key file."""

    def __init__(self, path: Path, expiration_min: int,
                 clock: Callable[[], float] = time.time, tenants: Sequence[str] = ()) -> None:
        self.path = path
        self.expiration_s = expiration_min * 60
        self._clock = clock
        self._keys: dict[KeyKind, _Key] = {}
        self._tenants = tuple(tenants)
        #: key -> tenant, for the tenants' own inference keys.
        self._tenant_keys: dict[str, str] = {}

    @property
    def has_tenant_keys(self) -> bool:
        return bool(self._tenants)

    def start(self) -> None:
        for kind in KeyKind:
            self._keys[kind] = self._new_key(kind)
        self._tenant_keys = {secrets.token_urlsafe(18): tenant for tenant in self._tenants}
        self._write()

    def tenant_of(self, token: str | None) -> str | None:
        """The tenant whose inference key ``token`` is (None: no tenant's)."""
        return self._tenant_keys.get(token) if token is not None else None

    def _new_key(self, kind: KeyKind) -> _Key:
        expires = None if kind is KeyKind.API else self._clock() + self.expiration_s
        return _Key(secrets.token_urlsafe(18), expires)

    def _document(self) -> dict[str, Any]:
        document: dict[str, Any] = {}
        for kind, key in self._keys.items():
            entry = {"key": key.value}
            if key.expires_at is not None:
                entry["expiration time"] = _timestamp(key.expires_at)
            document[kind.value] = entry
        if self._tenant_keys:
            document["tenants"] = {tenant: {"key": key}
                                   for key, tenant in self._tenant_keys.items()}
        return document

    def _write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(8)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(self._document(), fh, indent=2)
        os.replace(tmp, self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def check(self, kind: KeyKind, headers: Iterable[tuple[bytes, bytes]]) -> None:
        """Raise Unauthorized unless the request carries the current, unexpired ``kind`` key."""
        token = bearer_token(headers)
        if kind is KeyKind.INFERENCE and token in self._tenant_keys:
            return  # a tenant's own key (it never expires)
        key = self._keys.get(kind)
        if token is None or key is None or not hmac.compare_digest(token.encode(),
                                                                   key.value.encode()):
            raise Unauthorized(
                f"Token Authorization failed: send the {kind.value} key from {self.path.name} "
                f"as 'Authorization: Bearer <key>'")
        if key.expires_at is not None and self._clock() > key.expires_at:
            raise Unauthorized(f"Token Authorization failed: the {kind.value} key has expired; "
                               "get a new one with GET /token?type=" + kind.value)

    def rotate(self, kind_name: str) -> dict[str, str]:
        """Replace the inference or management key; returns the new key-file entry."""
        try:
            kind = KeyKind(kind_name)
        except ValueError:
            kind = None
        if kind not in (KeyKind.INFERENCE, KeyKind.MANAGEMENT):
            raise BadRequest("parameter type must be inference or management")
        assert kind is not None
        self._keys[kind] = self._new_key(kind)
        self._write()
        entry: dict[str, str] = self._document()[kind.value]
        return entry
