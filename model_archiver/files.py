"""An archive's files, for the model and the workflow archivers alike: inputs checked, names
collected and kept unique, the zip written whole, a manifest read back within a bound.

Each archiver passes its own error class (``ModelArchiverError``, ``WorkflowArchiverError``),
so that its users catch one type, and its own reserved folder (``MAR-INF``, ``WAR-INF``).
"""

from __future__ import annotations

import filecmp
import os
import secrets
import zipfile
from collections.abc import Iterable
from pathlib import Path

from model_archiver.paths import Unsafe, UnsafePath, contained

__all__ = [
    "SKIPPED_DIRS",
    "ArchiveEntries",
    "existing_file",
    "read_folder_member",
    "read_zip_member",
    "temp_sibling",
    "write_zip",
]

SKIPPED_DIRS = frozenset({"__pycache__", "__MACOSX"})
"""Folders never worth shipping inside an archive (TorchServe's archivers skip them too);
hidden folders (``.git``) are left out as well."""


def existing_file(path: str, flag: str, error: type[Exception]) -> Path:
    """``path``, which the CLI's ``flag`` named, as a ``Path``; ``error`` unless it is a file."""
    source = Path(path)
    if not source.is_file():
        what = "is not a file" if source.exists() else "does not exist"
        raise error(f"{flag}: {path} {what}")
    return source


class ArchiveEntries:
    """The files one archive will hold: archive name -> source file.

    A name under the reserved folder, or one that would land outside the archive, is an
    error; so are two different files for one name (one would silently be dropped). The same
    file given twice (say, the handler also in ``--extra-files``) is stored once.
    """

    def __init__(self, reserved: str, error: type[Exception]) -> None:
        self._reserved = reserved
        self._error = error
        self._files: dict[str, Path] = {}

    def add(self, name: str, source: Path) -> None:
        """Store ``source`` as ``name`` (a relative POSIX path)."""
        try:  # never from base names and walks; a guard
            path = contained(name)
        except UnsafePath as exc:
            raise self._error(f"{source}: {name!r} would land outside the archive: it "
                              f"{exc.why.value}") from None
        if not path.parts:
            raise self._error(f"{source}: {name!r} names no file in the archive")
        if path.parts[0] == self._reserved:
            raise self._error(
                f"{source}: {self._reserved}/ is reserved for the archive manifest")
        previous = self._files.get(name)
        if previous is None:
            self._files[name] = source
            return
        if previous.resolve() != source.resolve() and not filecmp.cmp(previous, source, False):
            raise self._error(
                f"{previous} and {source} would both be stored as {name!r} in the archive")

    def add_file(self, source: Path) -> None:
        """Store ``source`` at the archive root under its base name."""
        self.add(source.name, source)

    def add_extra_files(self, extras: Iterable[str], *, links_may_leave: bool) -> None:
        """``--extra-files``: a file lands at the root under its base name, a folder's files
        land at the root with their paths below it (sub-folders kept).

        Links in a folder are followed; with ``links_may_leave`` False, one that leads out of
        the folder is an error (it would ship a file the user never put there). A folder
        reached twice is walked once; a broken link is an error; sockets and pipes are left
        out.
        """
        for extra in extras:
            source = Path(extra)
            if source.is_dir():
                for name, file in self._walk(source, links_may_leave):
                    self.add(name, file)
            elif source.is_file():
                self.add_file(source)
            else:
                raise self._error(f"--extra-files: {extra} does not exist")

    def sorted(self) -> list[tuple[str, Path]]:
        """(archive name, source file) pairs, by name."""
        return sorted(self._files.items())

    def _walk(self, root: Path, links_may_leave: bool) -> list[tuple[str, Path]]:
        found: list[tuple[str, Path]] = []
        seen: set[Path] = set()
        for directory, subdirs, files in os.walk(root, followlinks=True):
            here = Path(directory)
            real = self._followed(root, here, links_may_leave)
            if real in seen:  # a link back up the tree would otherwise recurse forever
                subdirs[:] = []
                continue
            seen.add(real)
            subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS
                                and not d.startswith("."))
            for name in sorted(files):
                file = here / name
                target = self._followed(root, file, links_may_leave)
                if not file.exists():
                    raise self._error(f"--extra-files: {file} is a broken link to {target}")
                if file.is_file():  # not a socket or a pipe: nothing to ship
                    found.append((file.relative_to(root).as_posix(), file))
        return found

    def _followed(self, root: Path, path: Path, links_may_leave: bool) -> Path:
        """Where ``path`` (found in ``root``) leads, its links followed: inside ``root``
        unless ``links_may_leave``."""
        try:
            if links_may_leave:
                return path.resolve()
            return contained(path.relative_to(root), root)
        except (OSError, RuntimeError):  # 3.11's resolve: RuntimeError for a link loop
            raise self._error(f"--extra-files: {path} is a link loop") from None
        except UnsafePath as exc:
            if exc.why is Unsafe.UNRESOLVABLE:
                raise self._error(f"--extra-files: {path} is a link loop") from None
            raise self._error(f"--extra-files: {path} links to {exc.target}, outside "
                              f"{root}") from None


def temp_sibling(target: Path) -> Path:
    """A fresh temporary name beside ``target``, so that the final rename cannot cross file
    systems and a reader never sees a half-written archive."""
    return target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")


def write_zip(target: Path, entries: Iterable[tuple[str, Path]], manifest_path: str,
              manifest_json: str, compression: int = zipfile.ZIP_DEFLATED) -> None:
    """Write the zip archive ``target`` at once, complete: the manifest first (so that a
    streaming reader finds it without a full scan), then ``entries`` in their order."""
    tmp = temp_sibling(target)
    try:
        # Files dated before 1980 (some package managers reset mtimes) get 1980-01-01.
        with zipfile.ZipFile(tmp, "x", compression=compression,
                             strict_timestamps=False) as archive:
            archive.writestr(manifest_path, manifest_json)
            for name, source in entries:
                archive.write(source, name)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def read_folder_member(folder: Path, member: str, limit: int, error: type[Exception]) -> bytes:
    """The bytes of ``member`` of an unpacked archive; ``error`` when it is missing,
    unreadable or over ``limit`` bytes."""
    path = folder / member
    try:
        with path.open("rb") as stream:
            data = stream.read(limit + 1)
    except FileNotFoundError:
        raise error(f"{folder} has no {member}") from None
    except OSError as exc:
        raise error(f"cannot read {path}: {exc}") from exc
    return _within(data, folder, member, limit, error)


def read_zip_member(source: Path, member: str, limit: int, error: type[Exception]) -> bytes:
    """The bytes of ``member`` of a zip archive, read no further than ``limit`` bytes (a
    small compressed member may inflate to any size); ``error`` as ``read_folder_member``."""
    try:
        with zipfile.ZipFile(source) as archive:
            try:
                info = archive.getinfo(member)
            except KeyError:
                raise error(f"{source} has no {member}") from None
            with archive.open(info) as stream:
                data = stream.read(limit + 1)
    except (OSError, zipfile.BadZipFile) as exc:
        raise error(f"cannot read {source}: {exc}") from exc
    return _within(data, source, member, limit, error)


def _within(data: bytes, source: Path, member: str, limit: int,
            error: type[Exception]) -> bytes:
    if len(data) > limit:
        raise error(f"{source}: {member} is over {limit} bytes")
    return data
