"""Model snapshots as TorchServe writes them, and restoring the latest one at start.

After every change (register, scale, set-default, unregister) the registered models and
their settings are written to ``{log_location}/config/<timestamp>-snapshot.cfg`` (mode 0600)
as a properties file with TorchServe's ``model_snapshot`` JSON. ``torchserve --start``
without ``--models`` (and without ``--ncs``) registers them again.
"""

from __future__ import annotations

import calendar
import json
import logging
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import javaproperties

from frontend.config import parse_model_snapshot
from frontend.models.loader import RegisterRequest
from frontend.models.registry import ModelRegistry
from frontend.settings import Source, read_layer

logger = logging.getLogger(__name__)

SUFFIX = "-snapshot.cfg"
KEEP = 20
#: A snapshot file larger than this is not one of ours (each entry takes a few hundred bytes).
MAX_SNAPSHOT_BYTES = 16 * 1024 * 1024


def snapshot_document(registry: ModelRegistry) -> dict[str, Any]:
    models: dict[str, dict[str, dict[str, Any]]] = {}
    for model in registry:
        if model.workflow is not None:
            continue  # a workflow's node: registered with its workflow (not in snapshots)
        s = model.settings
        models.setdefault(model.name, {})[model.version] = {
            "defaultVersion": registry.default_version(model.name) == model.version,
            "marName": model.archive.url,
            **s.torchserve_fields(),
            "handler": model.handler,
            "batchPolicy": s.batch_policy.value,
            **({"deviceGroup": s.device_group, "deviceWeight": s.device_weight}
               if s.device_group else {}),
        }
    count = sum(len(versions) for versions in models.values())
    return {"name": "snapshot", "modelCount": count, "created": int(time.time() * 1000),
            "models": models}


class Snapshots:
    def __init__(self, folder: Path, enabled: bool) -> None:
        self.folder = folder
        self.enabled = enabled
        #: The newest snapshot's time (ms since the epoch): each name is later than the last.
        self._last_ms: int | None = None

    def _stamp(self) -> str:
        """TorchServe's ``yyyyMMddHHmmssSSS`` in UTC, from one clock reading; strictly later
        than every snapshot already in the folder, so sorting the names sorts the changes
        (two changes in one millisecond, a clock step back, a daylight-saving hour)."""
        if self._last_ms is None:
            names = sorted(p.name for p in self.folder.glob(f"*{SUFFIX}"))
            self._last_ms = _stamp_ms(names[-1]) if names else -1
        ms = max(time.time_ns() // 1_000_000, self._last_ms + 1)
        self._last_ms = ms
        return time.strftime("%Y%m%d%H%M%S", time.gmtime(ms // 1000)) + f"{ms % 1000:03d}"

    def save(self, registry: ModelRegistry) -> Path | None:
        if not self.enabled:
            return None
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.folder / f"{self._stamp()}{SUFFIX}"
        text = javaproperties.dumps(
            {"model_snapshot": json.dumps(snapshot_document(registry))}, timestamp=False)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
        for old in sorted(self.folder.glob(f"*{SUFFIX}"))[:-KEEP]:
            old.unlink(missing_ok=True)
        return path

    def latest(self) -> dict[str, Any] | None:
        """The newest snapshot that reads as one, checked (``check_model_snapshot``). A file
        that does not (not UTF-8, not a properties file, no ``model_snapshot``, malformed
        JSON or structure, too large) is skipped with one line naming it and what is wrong:
        a server restarting after a bad write must not crash into it again."""
        if not self.folder.is_dir():
            return None
        for path in sorted(self.folder.glob(f"*{SUFFIX}"), reverse=True):
            try:
                return read_snapshot(path)
            except (OSError, ValueError) as exc:
                logger.error("skipping unreadable snapshot %s: %s", path, exc)
        return None


def read_snapshot(path: Path) -> dict[str, Any]:
    """One snapshot file's ``model_snapshot``. Raises OSError, ValueError (what is wrong)."""
    with path.open("rb") as fh:
        data = fh.read(MAX_SNAPSHOT_BYTES + 1)
    if len(data) > MAX_SNAPSHOT_BYTES:
        raise ValueError(f"larger than {MAX_SNAPSHOT_BYTES} bytes")
    try:
        properties = javaproperties.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if "model_snapshot" not in properties:
        raise ValueError("it has no model_snapshot key")
    return parse_model_snapshot(properties["model_snapshot"])


def _stamp_ms(name: str) -> int:
    """The time in a snapshot's name, in ms since the epoch (-1 when it is not a stamp)."""
    try:
        whole = calendar.timegm(time.strptime(name[:14], "%Y%m%d%H%M%S"))
        return whole * 1000 + int(name[14:17])
    except ValueError:
        return -1


def restore_requests(document: Mapping[str, Any]) -> tuple[list[RegisterRequest], dict[str, str]]:
    """Registrations for every model of a snapshot (its structure checked:
    ``check_model_snapshot``), and each model's default version."""
    requests: list[RegisterRequest] = []
    defaults: dict[str, str] = {}
    for name, versions in document.get("models", {}).items():
        for version, entry in versions.items():
            try:
                settings = read_layer(entry, Source.JSON)
            except ValueError as exc:
                logger.error("snapshot: not restoring model %s version %s: %s", name, version,
                             exc)
                continue
            requests.append(RegisterRequest(
                url=entry["marName"],
                model_name=name,
                handler=entry.get("handler"),
                settings=settings,
                synchronous=False,
                loaded_at_startup=True,
            ))
            if entry.get("defaultVersion"):
                defaults[name] = version
    return requests, defaults
