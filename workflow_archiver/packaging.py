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
  folder); links inside it are followed only while they stay inside it, and hidden folders and
  ``__pycache__`` are left out;
- two different files for one name in the archive are an error, not a silent overwrite, and
  ``WAR-INF/`` is reserved for the manifest;
- nothing is written outside the export path (TorchServe's tool first copies the inputs into
  ``$TMPDIR/<workflow-name>``, deleting whatever was there), and the archive appears at once,
  complete (written under a temporary name, then renamed); an existing one is replaced only
  with ``force``.
"""

from __future__ import annotations

import filecmp
import os
import secrets
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from model_archiver import names
from workflow_archiver.errors import WorkflowArchiverError
from workflow_archiver.manifest import MANIFEST_PATH, WAR_INF, WorkflowManifest
from workflow_archiver.spec import MAX_SPEC_BYTES, WorkflowSpec, handler_names, parse_spec

__all__ = ["ARCHIVE_SUFFIX", "BuiltWorkflow", "WorkflowOptions", "archive_path",
           "build_workflow_archive"]

ARCHIVE_SUFFIX = ".war"
_SKIPPED_DIRS = frozenset({"__pycache__", "__MACOSX"})
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

    spec_path = _existing_file(options.spec_file, "--spec-file")
    handler_path = _existing_file(options.handler, "--handler")
    if handler_path.suffix != ".py":
        raise WorkflowArchiverError(
            f"--handler: {options.handler} is not a .py file (the server imports it as a "
            f"Python module)")
    handler_source = _read(handler_path, MAX_HANDLER_BYTES, "--handler")
    spec = parse_spec(_read(spec_path, MAX_SPEC_BYTES, "--spec-file"), options.workflow_name,
                      functions=handler_names(handler_source, handler_path.name))

    entries: dict[str, Path] = {}
    _add_entry(entries, spec_path.name, spec_path)
    _add_entry(entries, handler_path.name, handler_path)
    for extra in options.extra_files:
        source = Path(extra)
        if source.is_dir():
            for name, file in _walk(source):
                _add_entry(entries, name, file)
        elif source.is_file():
            _add_entry(entries, source.name, source)
        else:
            raise WorkflowArchiverError(f"--extra-files: {extra} does not exist")

    target = archive_path(options)
    if target.is_dir() and not target.is_symlink():
        raise WorkflowArchiverError(f"{target} is a directory")
    if (target.exists() or target.is_symlink()) and not options.force:
        raise WorkflowArchiverError(f"{target} already exists; use -f/--force to overwrite it")
    manifest = WorkflowManifest(workflow_name=options.workflow_name,
                                spec_file=spec_path.name, handler=handler_path.name)
    ordered = sorted(entries.items())
    try:
        _write_zip(target, ordered, manifest)
    except OSError as exc:
        raise WorkflowArchiverError(f"cannot write {target}: {exc}") from exc
    return BuiltWorkflow(target, manifest, spec,
                         (MANIFEST_PATH, *(name for name, _ in ordered)))


def _existing_file(path: str, flag: str) -> Path:
    source = Path(path)
    if not source.is_file():
        what = "is not a file" if source.exists() else "does not exist"
        raise WorkflowArchiverError(f"{flag}: {path} {what}")
    return source


def _read(path: Path, limit: int, flag: str) -> bytes:
    try:
        with path.open("rb") as stream:
            data = stream.read(limit + 1)
    except OSError as exc:
        raise WorkflowArchiverError(f"{flag}: cannot read {path}: {exc}") from exc
    if len(data) > limit:
        raise WorkflowArchiverError(f"{flag}: {path} is over {limit} bytes")
    return data


def _walk(root: Path) -> list[tuple[str, Path]]:
    """(archive name, file) for the files under ``root``, relative to it.

    A link is followed only when its target is inside ``root`` (a link out of the tree would
    ship a file the user never put there: an error); a folder reached twice is walked once.
    """
    top = root.resolve()
    found: list[tuple[str, Path]] = []
    seen: set[Path] = set()
    for directory, subdirs, files in os.walk(root, followlinks=True):
        here = Path(directory)
        real = here.resolve()
        if not real.is_relative_to(top):
            raise WorkflowArchiverError(
                f"--extra-files: {here} links to {real}, outside {root}")
        if real in seen:
            subdirs[:] = []
            continue
        seen.add(real)
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(files):
            file = here / name
            if not file.resolve().is_relative_to(top):
                raise WorkflowArchiverError(
                    f"--extra-files: {file} links to {file.resolve()}, outside {root}")
            if not file.is_file():
                continue  # a broken link, a socket, a fifo: nothing to ship
            found.append((file.relative_to(root).as_posix(), file))
    return found


def _add_entry(entries: dict[str, Path], name: str, source: Path) -> None:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:  # not from base names and walks; a guard
        raise WorkflowArchiverError(f"{source}: {name!r} would land outside the archive")
    if path.parts[0] == WAR_INF:
        raise WorkflowArchiverError(f"{source}: {WAR_INF}/ is reserved for the manifest")
    previous = entries.get(name)
    if previous is None:
        entries[name] = source
        return
    # The same file given twice (the handler also in --extra-files) is harmless; two
    # different files for one name would silently drop one of them.
    if previous.resolve() != source.resolve() and not filecmp.cmp(previous, source, False):
        raise WorkflowArchiverError(
            f"{previous} and {source} would both be stored as {name!r} in the archive")


def _write_zip(target: Path, entries: list[tuple[str, Path]], manifest: WorkflowManifest
               ) -> None:
    # Beside the target, so that the rename cannot cross file systems.
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    try:
        with zipfile.ZipFile(tmp, "x", compression=zipfile.ZIP_DEFLATED,
                             strict_timestamps=False) as archive:
            # The manifest first (torch-workflow-archiver writes it last; readers do not care),
            # so that a streaming reader finds it at once.
            archive.writestr(MANIFEST_PATH, manifest.to_json())
            for name, source in entries:
                archive.write(source, name)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
