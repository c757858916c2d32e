"""Build a model archive from model files, as torch-model-archiver does.

Every input lands flat at the archive root under its base name (an ``--extra-files``
directory contributes its contents, sub-folders kept), and ``MAR-INF/MANIFEST.json``
records those names. Three outputs: ``<name>.mar`` (zip), ``<name>.tar.gz`` (one top
folder ``<name>/``) or an unpacked folder ``<name>/``.
"""

from __future__ import annotations

import os
import re
import shutil
import tarfile
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from io import BytesIO
from pathlib import Path, PurePosixPath

from model_archiver import names
from model_archiver.errors import ModelArchiverError
from model_archiver.files import ArchiveEntries, existing_file, temp_sibling, write_zip
from model_archiver.handlers import resolve_handler
from model_archiver.manifest import MANIFEST_PATH, Manifest

__all__ = [
    "MODEL_NAME_PATTERN",
    "ArchiveFormat",
    "ArchiveOptions",
    "archive_path",
    "build_archive",
]

MODEL_NAME_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")
"""Allowed model names; the name becomes a file name and part of URLs."""

_MAR_INF = PurePosixPath(MANIFEST_PATH).parts[0]


class ArchiveFormat(str, Enum):
    """Output layouts, named as torch-model-archiver's ``--archive-format`` values."""

    DEFAULT = "default"
    """``<name>.mar``: a deflated zip."""
    TGZ = "tgz"
    """``<name>.tar.gz``: a gzip tar with one top folder ``<name>/``."""
    NO_ARCHIVE = "no-archive"
    """``<name>/``: the archive contents, unpacked."""
    ZIP_STORE = "zip-store"
    """``<name>.mar``: a zip without compression (fast for large, incompressible weights)."""

    @property
    def suffix(self) -> str:
        """File name suffix of the output for this format."""
        return _SUFFIXES[self]


_SUFFIXES: Mapping[ArchiveFormat, str] = {
    ArchiveFormat.DEFAULT: ".mar",
    ArchiveFormat.TGZ: ".tar.gz",
    ArchiveFormat.NO_ARCHIVE: "",
    ArchiveFormat.ZIP_STORE: ".mar",
}


@dataclass(frozen=True, kw_only=True)
class ArchiveOptions:
    """Everything ``build_archive`` needs; field names follow the CLI flags."""

    model_name: str
    """``--model-name``: archive file name and ``modelName`` in the manifest."""
    handler: str
    """``--handler``: a built-in handler name or a path to a .py file, optionally ``:function``."""
    version: str | None = "1.0"
    """``--version``: recorded as ``modelVersion``; None leaves it out."""
    serialized_file: str | None = None
    """``--serialized-file``: the weights file."""
    model_file: str | None = None
    """``--model-file``: the Python file with the model class (eager mode)."""
    extra_files: tuple[str, ...] = ()
    """``--extra-files``: files to add; a directory adds its contents at the archive root."""
    requirements_file: str | None = None
    """``--requirements-file``: per-model pip requirements."""
    config_file: str | None = None
    """``--config-file``: per-model YAML configuration."""
    export_path: Path = Path(".")
    """``--export-path``: existing directory the output is written to."""
    archive_format: ArchiveFormat = ArchiveFormat.DEFAULT
    """``--archive-format``: see ``ArchiveFormat``."""
    force: bool = False
    """``--force``: replace an existing output instead of failing."""
    runtime: str = "python"
    """``--runtime``: recorded in the manifest."""

    def __post_init__(self) -> None:
        # Accept the plain strings the CLI and callers naturally have ("tgz").
        try:
            archive_format = ArchiveFormat(self.archive_format)
        except ValueError:
            choices = ", ".join(f.value for f in ArchiveFormat)
            raise ModelArchiverError(
                f"unknown archive format {self.archive_format!r}; choose one of: {choices}"
            ) from None
        object.__setattr__(self, "archive_format", archive_format)
        object.__setattr__(self, "export_path", Path(self.export_path))


def archive_path(options: ArchiveOptions) -> Path:
    """Return where ``build_archive`` writes its output for these options."""
    return options.export_path / f"{options.model_name}{options.archive_format.suffix}"


def build_archive(options: ArchiveOptions) -> Path:
    """Validate the inputs, write the archive and return its path.

    The output is first written under a temporary name in the export directory and then
    renamed, so a reader never sees a half-written archive.
    """
    _check_model_name(options.model_name)
    _check_version(options.version)
    if not options.export_path.is_dir():
        raise ModelArchiverError(f"export path {options.export_path} is not an existing directory")

    entries = ArchiveEntries(_MAR_INF, ModelArchiverError)
    handler = _collect_inputs(options, entries)
    target = archive_path(options)
    if (target.exists() or target.is_symlink()) and not options.force:
        raise ModelArchiverError(f"{target} already exists; use --force to overwrite it")

    manifest = Manifest(
        model_name=options.model_name,
        model_version=options.version or None,
        handler=handler,
        serialized_file=_base_name(options.serialized_file),
        model_file=_base_name(options.model_file),
        requirements_file=_base_name(options.requirements_file),
        config_file=_base_name(options.config_file),
        runtime=options.runtime,
    )
    ordered = entries.sorted()
    try:
        if options.archive_format is ArchiveFormat.NO_ARCHIVE:
            _write_folder(target, ordered, manifest)
        elif options.archive_format is ArchiveFormat.TGZ:
            _write_tgz(target, options.model_name, ordered, manifest)
        else:
            stored = options.archive_format is ArchiveFormat.ZIP_STORE
            write_zip(target, ordered, MANIFEST_PATH, manifest.to_json(),
                      zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED)
    except OSError as exc:
        raise ModelArchiverError(f"cannot write {target}: {exc}") from exc
    return target


def _check_model_name(name: str) -> None:
    if not MODEL_NAME_PATTERN.fullmatch(name):
        raise ModelArchiverError(
            f"invalid model name {name!r}: it must start with a letter and contain only "
            f"letters, digits, '_', '-' and '.' (pattern {MODEL_NAME_PATTERN.pattern})"
        )
    problem = names.name_problem(name)
    if problem:
        raise ModelArchiverError(problem)


def _check_version(version: str | None) -> None:
    problem = names.version_problem(version) if version else None
    if problem:
        raise ModelArchiverError(problem)


def _base_name(path: str | None) -> str | None:
    return os.path.basename(path) if path else None


def _collect_inputs(options: ArchiveOptions, entries: ArchiveEntries) -> str:
    """Fill ``entries`` (archive name -> source file) and return the manifest's handler."""
    for flag, path in (
        ("--model-file", options.model_file),
        ("--serialized-file", options.serialized_file),
        ("--requirements-file", options.requirements_file),
        ("--config-file", options.config_file),
    ):
        if path:
            entries.add_file(existing_file(path, flag, ModelArchiverError))

    handler, handler_source = resolve_handler(options.handler)
    if handler_source is not None:
        entries.add_file(handler_source)
    # Links are followed wherever they lead: a Hugging Face snapshot folder, say, is links
    # into its cache's blobs, and their contents are what the user means to ship.
    entries.add_extra_files(options.extra_files, links_may_leave=True)
    return handler


def _write_tgz(
    target: Path, model_name: str, entries: list[tuple[str, Path]], manifest: Manifest
) -> None:
    tmp = temp_sibling(target)
    data = manifest.to_json().encode()
    info = tarfile.TarInfo(f"{model_name}/{MANIFEST_PATH}")
    info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
    try:
        with tarfile.open(tmp, "x:gz") as archive:
            archive.addfile(info, BytesIO(data))
            for name, source in entries:
                archive.add(
                    source, arcname=f"{model_name}/{name}", recursive=False, filter=_anonymous
                )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _anonymous(info: tarfile.TarInfo) -> tarfile.TarInfo:
    # The builder's user and group mean nothing on the machine that serves the model.
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _write_folder(target: Path, entries: list[tuple[str, Path]], manifest: Manifest) -> None:
    tmp = temp_sibling(target)
    tmp.mkdir()
    try:
        for name, source in entries:
            destination = tmp / name
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination)
        manifest_file = tmp / MANIFEST_PATH
        manifest_file.parent.mkdir(parents=True, exist_ok=True)
        manifest_file.write_text(manifest.to_json(), encoding="utf-8")
        # NOTE: replacing a folder is two steps (a directory rename cannot overwrite a
        # non-empty one), so a reader may briefly see no folder, but never a partial one.
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
