"""Build a workflow archive (.war), as torch-workflow-archiver 0.2.x does, but safely.

The archive is ``<export-path>/<workflow-name>.war``, a deflated zip of: the spec file and the
handler file at the root under their base names, each ``--extra-files`` file at the root under
its base name, and ``WAR-INF/MANIFEST.json`` (``workflow_archiver.manifest``). That is all
TorchServe's tool writes (it has no ``--archive-format``, no version flag and no requirements
file for workflows).

Where TorchServe's tool is careless, this one refuses or does better:

- the spec is checked as the server will check it (``workflow_archiver.spec``), with the
  handler file's functions, so a spec TorchServe would refuse at registration, or a function
  node the handler lacks, fails here with a clear message; what TorchServe would silently
  ignore comes back as warnings;
- ``--handler`` is required and must be a ``.py`` file (TorchServe's tool accepts none and
  then fails with a traceback; its server cannot load one without it);
- an ``--extra-files`` folder adds its files, sub-folders kept (TorchServe's tool fails on a
  folder); links inside it are followed only while they stay inside it, a broken link is an
  error, and hidden folders, ``__pycache__``, sockets and pipes are left out
  (``model_archiver.files``, which both archivers use);
- two different files for one name in the archive are an error, not a silent overwrite, and
  ``WAR-INF/`` is reserved for the manifest;
- nothing is written outside the export path (TorchServe's tool first copies the inputs into
  ``$TMPDIR/<workflow-name>``, deleting whatever was there), and the archive appears at once,
  complete (written under a temporary name, then renamed); an existing one is replaced only
  with ``force``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from model_archiver import names
from model_archiver.files import ArchiveEntries, existing_file, write_zip
from workflow_archiver.errors import WorkflowArchiverError
from workflow_archiver.manifest import MANIFEST_PATH, WAR_INF, WorkflowManifest
from workflow_archiver.spec import MAX_SPEC_BYTES, WorkflowSpec, handler_names, parse_spec

__all__ = ["ARCHIVE_SUFFIX", "BuiltWorkflow", "WorkflowOptions", "archive_path",
           "build_workflow_archive"]

ARCHIVE_SUFFIX = ".war"
MAX_HANDLER_BYTES = 16 << 20
"""A handler file of functions bigger than this is not one (it is read to check the spec)."""


@dataclass(frozen=True, kw_only=True)
class WorkflowOptions:
    """Everything ``build_workflow_archive`` needs; the fields follow the CLI's flags."""

    workflow_name: str
    """``--workflow-name``: the archive's file name and ``workflowName`` in the manifest."""
    spec_file: str
    """``--spec-file``: the workflow's spec YAML."""
    handler: str
    """``--handler``: the Python file with the DAG's functions."""
    export_path: Path = Path(".")
    """``--export-path``: the existing folder the archive is written to."""
    extra_files: tuple[str, ...] = ()
    """``--extra-files``: more files (or folders) for the archive."""
    force: bool = False
    """``-f/--force``: replace an existing archive instead of failing."""


@dataclass(frozen=True)
class BuiltWorkflow:
    """What ``build_workflow_archive`` wrote."""

    path: Path
    manifest: WorkflowManifest
    spec: WorkflowSpec
    """The checked spec; its ``warnings`` are for the user."""
    members: tuple[str, ...]
    """The archive's file names, the manifest first."""


def archive_path(options: WorkflowOptions) -> Path:
    """Where ``build_workflow_archive`` writes for these options."""
    return Path(options.export_path) / f"{options.workflow_name}{ARCHIVE_SUFFIX}"


def build_workflow_archive(options: WorkflowOptions) -> BuiltWorkflow:
    """Check the inputs, write the archive and say what it holds."""
    problem = names.name_problem(options.workflow_name, "workflow name")
    if problem:
        raise WorkflowArchiverError(problem)
    export = Path(options.export_path)
    if not export.is_dir():
        raise WorkflowArchiverError(f"export path {export} is not an existing directory")

    spec_path = existing_file(options.spec_file, "--spec-file", WorkflowArchiverError)
    handler_path = existing_file(options.handler, "--handler", WorkflowArchiverError)
    if handler_path.suffix != ".py":
        raise WorkflowArchiverError(
            f"--handler: {options.handler} is not a .py file (the server imports it as a "
            f"Python module)")
    handler_source = _read(handler_path, MAX_HANDLER_BYTES, "--handler")
    spec = parse_spec(_read(spec_path, MAX_SPEC_BYTES, "--spec-file"), options.workflow_name,
                      functions=handler_names(handler_source, handler_path.name))

    entries = ArchiveEntries(WAR_INF, WorkflowArchiverError)
    entries.add_file(spec_path)
    entries.add_file(handler_path)
    entries.add_extra_files(options.extra_files, links_may_leave=False)

    target = archive_path(options)
    if target.is_dir() and not target.is_symlink():
        raise WorkflowArchiverError(f"{target} is a directory")
    if (target.exists() or target.is_symlink()) and not options.force:
        raise WorkflowArchiverError(f"{target} already exists; use -f/--force to overwrite it")
    manifest = WorkflowManifest(workflow_name=options.workflow_name,
                                spec_file=spec_path.name, handler=handler_path.name)
    ordered = entries.sorted()
    try:
        # The manifest first (torch-workflow-archiver writes it last; readers do not care).
        write_zip(target, ordered, MANIFEST_PATH, manifest.to_json())
    except OSError as exc:
        raise WorkflowArchiverError(f"cannot write {target}: {exc}") from exc
    return BuiltWorkflow(target, manifest, spec,
                         (MANIFEST_PATH, *(name for name, _ in ordered)))


def _read(path: Path, limit: int, flag: str) -> bytes:
    try:
        with path.open("rb") as stream:
            data = stream.read(limit + 1)
    except OSError as exc:
        raise WorkflowArchiverError(f"{flag}: cannot read {path}: {exc}") from exc
    if len(data) > limit:
        raise WorkflowArchiverError(f"{flag}: {path} is over {limit} bytes")
    return data
