"""The config.properties keys whose value is a JSON document: ``models`` (each model
version's settings) and ``model_snapshot`` (TorchServe's snapshot of the models to restore).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from frontend.config.values import parse_bool, shown
from frontend.settings import FIELDS, SettingsLayer, Source, read_layer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConfiguredVersion:
    """A model version's entry in the ``models=`` JSON of config.properties."""

    settings: SettingsLayer = field(default_factory=lambda: SettingsLayer())
    #: ``defaultVersion``: this version is the model's default.
    is_default_version: bool = False


#: Keys of an entry that are not settings: ``marName`` is TorchServe's bookkeeping, and so is
#: ``runtimeType`` (its snapshots write it; Python is the one runtime here).
_ENTRY_KEYS = frozenset({"marName", "defaultVersion", "runtimeType"})
_SETTING_KEYS = frozenset(setting.json for setting in FIELDS)


def parse_models_json(text: str) -> dict[str, dict[str, ConfiguredVersion]]:
    """Parse ``models={"name": {"1.0": {"batchSize": 8, ...}}}``."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError("expected a JSON object of model name -> version -> settings")
    models: dict[str, dict[str, ConfiguredVersion]] = {}
    for name, versions in raw.items():
        if not isinstance(versions, dict):
            raise ValueError(f"model {name!r}: expected an object of version -> settings")
        models[name] = {}
        for version, entry in versions.items():
            if not isinstance(entry, dict):
                raise ValueError(f"model {name!r} version {version!r}: expected an object")
            for key in sorted(set(entry) - _SETTING_KEYS - _ENTRY_KEYS):
                logger.warning("models: %s/%s: ignoring unsupported key %r", name, version, key)
            try:
                default = entry.get("defaultVersion", False)
                models[name][version] = ConfiguredVersion(
                    read_layer(entry, Source.JSON),
                    default if isinstance(default, bool) else parse_bool(str(default)))
            except ValueError as exc:
                raise ValueError(f"model {name!r} version {version!r}: {exc}") from exc
    return models


def _parse_json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value


def parse_model_snapshot(text: str) -> dict[str, Any]:
    """TorchServe's ``model_snapshot`` JSON, its structure checked (``check_model_snapshot``).
    Raises ValueError naming what is wrong and where."""
    document = _parse_json_object(text)
    check_model_snapshot(document)
    return document


def check_model_snapshot(document: Mapping[str, Any]) -> None:
    """A snapshot is ``{"models": {name: {version: {"marName": ..., ...}}}}``: raises
    ValueError, naming the place (``models.resnet.1.0.marName``), where it is not. The
    settings in each entry are checked when the model is restored (a bad one skips only that
    version)."""
    models = document.get("models")
    if not isinstance(models, dict):
        raise ValueError("'models' must be an object of model names")
    for name, versions in models.items():
        where = f"models.{shown(name)}"
        if not isinstance(versions, dict) or not versions:
            raise ValueError(f"{where} must be an object of versions")
        for version, entry in versions.items():
            at = f"{where}.{shown(version)}"
            if not isinstance(entry, dict):
                raise ValueError(f"{at} must be an object (with marName), not "
                                 f"{type(entry).__name__}")
            mar_name = entry.get("marName")
            if not isinstance(mar_name, str) or not mar_name.strip():
                raise ValueError(f"{at}.marName must name the archive")
            if not isinstance(entry.get("defaultVersion", False), bool):
                raise ValueError(f"{at}.defaultVersion must be true or false")
