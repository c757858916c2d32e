"""The workflow archive's manifest: ``WorkflowManifest`` <-> ``WAR-INF/MANIFEST.json``.

The JSON is what TorchServe's torch-workflow-archiver 0.2.x writes (``json.dumps(indent=2)``,
keys in this order), so archives built here load in TorchServe and the other way round::

    {
      "createdOn": "25/11/2026 22:10:44",
      "workflow": {
        "workflowName": "dog_breed_wf",
        "specFile": "workflow_dog_breed_classification.yaml",
        "handler": "workflow_dog_breed_classification_handler.py"
      },
      "archiverVersion": "0.2.15"
    }

``specFile`` and ``handler`` are file names at the archive root (the archiver stores every
input flat, under its base name). TorchServe's reader (``archive/workflow/Manifest.java``) also
knows an optional top-level ``description``, which no archiver writes; it is kept when present.
What TorchServe requires, with its messages (``WorkflowArchive.validate``): a ``workflow``
object ("Missing Workflow entry in manifest file."), ``workflowName`` ("Workflow name is not
defined."; the register API's ``workflow_name`` may supply it), ``archiverVersion`` ("Workflow
archive version is not defined.") and ``createdOn`` ("Workflow archive createdOn is not
defined."). It then opens ``specFile`` and ``handler`` without checking them (a missing one is a
``NullPointerException``); here both are required, and must name a file inside the archive.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import Any

from model_archiver.files import read_folder_member, read_zip_member
from model_archiver.paths import UnsafePath, contained
from model_archiver.quoting import quoted
from workflow_archiver import __version__
from workflow_archiver.errors import WorkflowManifestError

__all__ = ["CREATED_ON_FORMAT", "MANIFEST_PATH", "WAR_INF", "WorkflowManifest", "read_manifest"]

WAR_INF = "WAR-INF"
"""The archive's reserved folder."""
MANIFEST_PATH = f"{WAR_INF}/MANIFEST.json"
"""Where the manifest lives, relative to the archive root."""
CREATED_ON_FORMAT = "%d/%m/%Y %H:%M:%S"
"""``createdOn`` format, as torch-workflow-archiver writes it (local time, day first)."""
MAX_MANIFEST_BYTES = 1 << 20
"""A manifest is a few hundred bytes; anything past this is not one."""


def _now() -> str:
    return datetime.now().strftime(CREATED_ON_FORMAT)


@dataclass(frozen=True, kw_only=True)
class WorkflowManifest:
    """What a workflow archive holds: its name and the names of its spec and handler files."""

    workflow_name: str
    """``workflow.workflowName``: the name the workflow is registered under by default."""
    spec_file: str
    """``workflow.specFile``: the spec YAML, a path relative to the archive root."""
    handler: str
    """``workflow.handler``: the Python file of the DAG's functions, relative to the root."""
    created_on: str = field(default_factory=_now)
    """``createdOn``: build time, formatted with ``CREATED_ON_FORMAT``."""
    archiver_version: str = __version__
    """``archiverVersion``: version of the tool that built the archive."""
    description: str | None = None
    """``description``: read by TorchServe, written by no archiver; kept when present."""

    def to_dict(self) -> dict[str, Any]:
        """The manifest as torch-workflow-archiver's JSON object, its keys in its order."""
        data: dict[str, Any] = {"createdOn": self.created_on}
        if self.description is not None:
            data["description"] = self.description
        data["workflow"] = {"workflowName": self.workflow_name, "specFile": self.spec_file,
                            "handler": self.handler}
        data["archiverVersion"] = self.archiver_version
        return data

    def to_json(self) -> str:
        """The text of ``WAR-INF/MANIFEST.json``, formatted as torch-workflow-archiver does."""
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *,
                  workflow_name: str | None = None) -> WorkflowManifest:
        """Build a manifest from a parsed ``MANIFEST.json``; unknown keys are ignored.

        ``workflow_name`` (the register API's parameter) replaces the manifest's name, before
        the checks, as TorchServe replaces it: a manifest without one is then accepted.
        """
        if not isinstance(data, Mapping):
            raise WorkflowManifestError("manifest must be a JSON object")
        workflow = data.get("workflow")
        if not isinstance(workflow, Mapping):
            raise WorkflowManifestError("Missing Workflow entry in manifest file.")
        name = workflow_name or _text(workflow, "workflowName")
        if not name:
            raise WorkflowManifestError("Workflow name is not defined.")
        archiver_version = _text(data, "archiverVersion")
        if archiver_version is None:
            raise WorkflowManifestError("Workflow archive version is not defined.")
        created_on = _text(data, "createdOn")
        if created_on is None:
            raise WorkflowManifestError("Workflow archive createdOn is not defined.")
        return cls(workflow_name=name,
                   spec_file=_member(workflow, "specFile"),
                   handler=_member(workflow, "handler"),
                   created_on=created_on,
                   archiver_version=archiver_version,
                   description=_text(data, "description"))

    @classmethod
    def from_json(cls, text: str | bytes, *,
                  workflow_name: str | None = None) -> WorkflowManifest:
        """Parse the text of a ``MANIFEST.json`` (``workflow_name``: as ``from_dict``)."""
        try:
            data = json.loads(text)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both land here
            raise WorkflowManifestError(f"manifest is not valid JSON: {exc}") from exc
        except RecursionError:
            raise WorkflowManifestError("manifest is not valid JSON: it nests too deeply"
                                        ) from None
        return cls.from_dict(data, workflow_name=workflow_name)


def _text(section: Mapping[str, Any], key: str) -> str | None:
    value = section.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise WorkflowManifestError(
            f'manifest key "{key}" must be a string, got {type(value).__name__}')
    return value


def _member(workflow: Mapping[str, Any], key: str) -> str:
    """A file named by the manifest: a relative path that stays inside the archive."""
    value = _text(workflow, key)
    if not value:
        raise WorkflowManifestError(f'manifest "workflow" section has no "{key}"')
    try:
        path = contained(value)  # "\\" separates parts too, as a Windows-made archive has it
    except UnsafePath:
        path = PurePosixPath()
    if not path.parts or path.parts[0] == WAR_INF or ":" in value:
        raise WorkflowManifestError(
            f'manifest "{key}" must name a file inside the archive, got {quoted(value)}')
    return value


def read_manifest(source: Path, *, workflow_name: str | None = None) -> WorkflowManifest:
    """Read the manifest of a .war (zip) or of an unpacked workflow folder; nothing is
    extracted (``workflow_name``: as ``WorkflowManifest.from_dict``)."""
    source = Path(source)
    if source.is_dir():
        text = read_folder_member(source, MANIFEST_PATH, MAX_MANIFEST_BYTES,
                                  WorkflowManifestError)
    elif zipfile.is_zipfile(source):
        text = read_zip_member(source, MANIFEST_PATH, MAX_MANIFEST_BYTES, WorkflowManifestError)
    elif source.exists():
        raise WorkflowManifestError(f"{source} is not a workflow archive (a .war zip)")
    else:
        raise WorkflowManifestError(f"workflow archive not found: {source}")
    try:
        return WorkflowManifest.from_json(text, workflow_name=workflow_name)
    except WorkflowManifestError as exc:
        raise WorkflowManifestError(f"{source}: {exc}") from exc
