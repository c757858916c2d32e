"""The archive manifest: ``Manifest`` <-> ``MAR-INF/MANIFEST.json``.

The JSON layout is TorchServe's, so archives built by ``torch-model-archiver`` load here and
archives built here load in TorchServe::

    {"createdOn": "22/11/2026 10:00:00", "runtime": "python",
     "model": {"modelName": "resnet", "serializedFile": "resnet.pt", "handler": "handler.py",
               "modelFile": "model.py", "modelVersion": "1.0", "requirementsFile": "req.txt",
               "configFile": "model-config.yaml"},
     "archiverVersion": "0.12.0"}

Optional keys are left out when they have no value.
"""

from __future__ import annotations

import json
import tarfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import Any

from model_archiver import __version__
from model_archiver.errors import ManifestError
from model_archiver.files import read_folder_member, read_zip_member

__all__ = [
    "CREATED_ON_FORMAT",
    "MANIFEST_PATH",
    "Manifest",
    "read_manifest",
]

MANIFEST_PATH = "MAR-INF/MANIFEST.json"
"""Where the manifest lives, relative to the archive root."""

CREATED_ON_FORMAT = "%d/%m/%Y %H:%M:%S"
"""``createdOn`` format, as torch-model-archiver writes it (local time, day first)."""

MAX_MANIFEST_BYTES = 1 << 20
"""A manifest is a few hundred bytes; ``read_manifest`` reads no further than this."""

# Manifest attribute -> key inside "model", in the order TorchServe writes them.
_MODEL_KEYS: tuple[tuple[str, str], ...] = (
    ("model_name", "modelName"),
    ("serialized_file", "serializedFile"),
    ("handler", "handler"),
    ("model_file", "modelFile"),
    ("model_version", "modelVersion"),
    ("extensions", "extensions"),
    ("requirements_file", "requirementsFile"),
    ("config_file", "configFile"),
)
_REQUIRED_MODEL_KEYS = frozenset({"modelName", "handler"})
_TAR_SUFFIXES = (".tar.gz", ".tgz")


def _now() -> str:
    return datetime.now().strftime(CREATED_ON_FORMAT)


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What an archive contains and how to load it; file fields hold archive-root names."""

    model_name: str
    """``modelName``: the name the model is registered under by default."""
    model_version: str | None = None
    """``modelVersion``: free-form version string, e.g. ``"1.0"``."""
    handler: str
    """``handler``: a built-in handler name, or a file name with an optional ``:function``."""
    serialized_file: str | None = None
    """``serializedFile``: the weights file (eager state dict, TorchScript, ...)."""
    model_file: str | None = None
    """``modelFile``: the Python file that defines the model class (eager mode)."""
    extensions: str | None = None
    """``extensions``: legacy field, kept so that it survives a round trip."""
    requirements_file: str | None = None
    """``requirementsFile``: per-model pip requirements."""
    config_file: str | None = None
    """``configFile``: per-model YAML configuration (batch size, ...)."""
    runtime: str = "python"
    """``runtime``: the language the handler runs in."""
    created_on: str = field(default_factory=_now)
    """``createdOn``: build time, formatted with ``CREATED_ON_FORMAT``."""
    archiver_version: str = __version__
    """``archiverVersion``: version of the tool that built the archive."""

    def to_dict(self) -> dict[str, Any]:
        """Return the manifest as TorchServe's JSON object, leaving out unset optional keys."""
        model: dict[str, str] = {}
        for attr, key in _MODEL_KEYS:
            value = getattr(self, attr)
            if value is not None:
                model[key] = value
        return {
            "createdOn": self.created_on,
            "runtime": self.runtime,
            "model": model,
            "archiverVersion": self.archiver_version,
        }

    def to_json(self) -> str:
        """Serialize to the text of ``MAR-INF/MANIFEST.json``."""
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        """Build a manifest from a parsed ``MANIFEST.json`` object.

        Unknown keys are ignored and optional keys may be missing: older torch-model-archiver
        versions wrote ``specificationVersion``/``modelServerVersion`` and no ``createdOn``.
        """
        if not isinstance(data, Mapping):
            raise ManifestError("manifest must be a JSON object")
        model = data.get("model")
        if model is None:
            raise ManifestError('manifest has no "model" section')
        if not isinstance(model, Mapping):
            raise ManifestError('manifest "model" section must be a JSON object')
        for key in sorted(_REQUIRED_MODEL_KEYS):
            if not model.get(key):
                raise ManifestError(f'manifest "model" section has no "{key}"')

        values = {attr: _optional_str(model, key) for attr, key in _MODEL_KEYS}
        return cls(
            **values,
            runtime=_optional_str(data, "runtime") or "python",
            created_on=_optional_str(data, "createdOn") or "",
            archiver_version=_optional_str(data, "archiverVersion") or "",
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse the text of a ``MANIFEST.json``."""
        try:
            data = json.loads(text)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both land here
            raise ManifestError(f"manifest is not valid JSON: {exc}") from exc
        return cls.from_dict(data)


def _optional_str(section: Mapping[str, Any], key: str) -> Any:
    """Return ``section[key]`` as a string, or None when it is absent or null."""
    value = section.get(key)
    if value is None:
        return None
    # Hand-written manifests sometimes carry "modelVersion": 1.0; str() keeps them loadable.
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise ManifestError(f'manifest key "{key}" must be a string, got {type(value).__name__}')
    return value


def read_manifest(source: Path) -> Manifest:
    """Read the manifest of a .mar (zip), a .tar.gz/.tgz, or an unpacked archive directory.

    Nothing is extracted to disk. A tgz archive holds one top folder ``<name>/`` with
    ``MAR-INF/MANIFEST.json`` inside, as torch-model-archiver's ``--archive-format tgz`` writes.
    """
    source = Path(source)
    if source.is_dir():
        return _read_from_dir(source)
    if not source.is_file():
        raise ManifestError(f"model archive not found: {source}")
    if source.name.endswith(_TAR_SUFFIXES):
        return _read_from_tar(source)
    if zipfile.is_zipfile(source):
        return _read_from_zip(source)
    raise ManifestError(
        f"{source} is not a model archive: expected a .mar (zip), .tar.gz/.tgz or a directory"
    )


def _read_from_dir(source: Path) -> Manifest:
    return _parse(read_folder_member(source, MANIFEST_PATH, MAX_MANIFEST_BYTES, ManifestError),
                  source)


def _read_from_zip(source: Path) -> Manifest:
    return _parse(read_zip_member(source, MANIFEST_PATH, MAX_MANIFEST_BYTES, ManifestError),
                  source)


def _read_from_tar(source: Path) -> Manifest:
    manifest_parts = tuple(PurePosixPath(MANIFEST_PATH).parts)
    text: bytes | None = None
    try:
        # Stream mode ("r|gz"): members are read once, front to back, and nothing is written.
        with tarfile.open(source, "r|gz") as archive:
            for member in archive:
                parts = tuple(p for p in PurePosixPath(member.name).parts if p != ".")
                if len(parts) == 3 and parts[1:] == manifest_parts and member.isfile():
                    stream = archive.extractfile(member)
                    if stream is not None:  # pragma: no branch - isfile() members have data
                        text = stream.read(MAX_MANIFEST_BYTES + 1)
                    break
    except (OSError, tarfile.TarError, EOFError) as exc:
        raise ManifestError(f"cannot read {source}: {exc}") from exc
    if text is None:
        raise ManifestError(f"{source} has no <model-name>/{MANIFEST_PATH}")
    if len(text) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{source}: {MANIFEST_PATH} is over {MAX_MANIFEST_BYTES} bytes")
    return _parse(text, source)


def _parse(text: bytes, source: Path) -> Manifest:
    try:
        return Manifest.from_json(text)
    except ManifestError as exc:
        raise ManifestError(f"{source}: {exc}") from exc
