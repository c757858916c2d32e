"""Find, fetch and unpack a workflow archive (.war), and read what it holds.

A .war (TorchServe's ``torch-workflow-archiver``, or ours) is a zip of the spec file (YAML),
the handler file of the workflow's functions, extra files, and ``WAR-INF/MANIFEST.json``
(read by ``workflow_archiver.manifest``, with TorchServe's checks and messages)::

    {"createdOn": "...", "archiverVersion": "0.2.x",
     "workflow": {"workflowName": "wf", "specFile": "wf.yaml", "handler": "wf_handler.py"}}

Where a register ``url`` points, as TorchServe resolves it: a bare file name is the workflow
store's (``workflow_store``, else the model store); an http(s) URL is downloaded into the
store and a ``file://`` URL copied there (both only where ``allowed_urls`` admits them), and
that copy is deleted again when the workflow goes; an absolute path is read where it is when
it lies in the store or ``allowed_urls`` admits it.
"""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from frontend.errors import (
    ArchiveError,
    BadRequest,
    Conflict,
    InvalidWorkflow,
    WorkflowNotFound,
    excerpt,
    quoted,
)
from frontend.models import archive as archives
from frontend.models.download import download_archive
from frontend.workflows.spec import WorkflowSpec, read_spec
from model_archiver.paths import UnsafePath, climbs, contained
from workflow_archiver import WorkflowArchiverError
from workflow_archiver.manifest import MANIFEST_PATH, WorkflowManifest
from workflow_archiver.packaging import MAX_HANDLER_BYTES
from workflow_archiver.spec import MAX_SPEC_BYTES

WAR_SUFFIX = ".war"
#: The most a .war may unpack to: a spec, a handler file of functions and a few extra files
#: (a workflow's models are archives of their own, named by the spec).
MAX_WAR_UNPACKED_BYTES = 256 * 1024 * 1024
#: A manifest is a few hundred bytes.
MAX_MANIFEST_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class WorkflowArchive:
    """An unpacked workflow archive."""

    #: The register url as given (describe and list show it).
    url: str
    name: str
    #: The unpacked archive (ours: removed with the workflow).
    directory: Path
    spec: WorkflowSpec
    #: The spec file's text (describe shows its ``dag`` as TorchServe does).
    spec_text: str
    #: The handler file of its functions, relative to ``directory``.
    handler: str
    #: The store's copy of a downloaded or file:// archive (removed with the workflow).
    fetched: Path | None = None

    def remove(self) -> None:
        """Delete what registering it put on disk: the unpacked archive, the fetched copy."""
        shutil.rmtree(self.directory, ignore_errors=True)
        if self.fetched is not None:
            self.fetched.unlink(missing_ok=True)


def locate(url: str, store: Path | None, allowed_urls: tuple[str, ...],
           max_bytes: int, *, given_by_operator: bool = False) -> tuple[Path, Path | None]:
    """The local .war a register ``url`` names, and the store's copy when one was made for it
    (blocking: a download; the caller runs it in a thread)."""
    if not url:
        raise BadRequest("Parameter url is required.")
    if store is None:
        raise WorkflowNotFound("Workflow store has not been configured.")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        try:
            path = download_archive(url, store, allowed_urls, max_bytes,
                                    suffixes=(WAR_SUFFIX,))
        except Conflict:
            stem = archives.archive_stem(Path(parts.path))
            raise Conflict(f"Workflow archive file already exists in the workflow store: "
                           f"{excerpt(stem + WAR_SUFFIX)}") from None
        except ArchiveError as exc:
            raise BadRequest(f"Failed to download archive from: {excerpt(url)} ({exc.message})"
                             ) from None
        return path, path
    if climbs(unquote(parts.path) if scheme == "file" else url):
        raise WorkflowNotFound(f"Relative path is not allowed in url: {excerpt(url)}")
    if scheme == "file":
        return _copy_file_url(url, unquote(parts.path), store, allowed_urls, given_by_operator)
    if scheme:
        raise BadRequest(f"Failed to download archive from: {excerpt(url)} (unsupported url "
                         f"scheme {quoted(scheme)})")
    if "/" not in url and "\\" not in url:
        path = store / url
    else:
        path = Path(url)
        if not given_by_operator and not _inside(path, store):
            archives.require_allowed(url, allowed_urls)
    if not _is_file(path):
        raise WorkflowNotFound(f"Workflow not found in workflow store: {excerpt(url)}")
    return path, None


def _copy_file_url(url: str, raw_path: str, store: Path, allowed_urls: tuple[str, ...],
                   given_by_operator: bool) -> tuple[Path, Path | None]:
    """A ``file://`` archive, copied into the store as TorchServe does (not when it is in the
    store already)."""
    source = Path(raw_path)
    if _inside(source, store):
        if not _is_file(source):
            raise WorkflowNotFound(f"Workflow not found in workflow store: {excerpt(url)}")
        return source, None
    if not given_by_operator:
        archives.require_allowed(url, allowed_urls)
    if not _is_file(source):
        raise BadRequest(f"Failed to download archive from: {excerpt(url)} (no such file)")
    target = store / source.name
    if target.exists():
        raise Conflict(f"Workflow archive file already exists in the workflow store: "
                       f"{excerpt(source.name)}")
    shutil.copyfile(source, target)
    return target, target


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is absolute and, links resolved, lies in ``folder``."""
    if not path.is_absolute():
        return False
    try:
        contained(path, folder, absolute=True)
    except UnsafePath:
        return False
    return True


def _is_file(path: Path) -> bool:
    """Whether ``path`` is a file; False for a name no file can have (too long, a NUL)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def unpack(url: str, source: Path, work_dir: Path, workflow_name: str | None,
           fetched: Path | None = None) -> WorkflowArchive:
    """Unpack ``source`` under ``work_dir`` and read its manifest, spec and handler
    (``workflow_name`` overrides the manifest's name); whatever fails leaves nothing."""
    directory = (work_dir / f"{archives.archive_stem(source)}-{uuid.uuid4().hex[:8]}").resolve()
    directory.mkdir(parents=True, mode=0o700)
    try:
        try:
            archives.extract_zip(source, directory, WAR_SUFFIX, MAX_WAR_UNPACKED_BYTES)
        except ArchiveError as exc:
            raise InvalidWorkflow(exc.message) from None
        path = directory / MANIFEST_PATH
        if not path.is_file():
            raise InvalidWorkflow(f"the archive has no {MANIFEST_PATH}: is it a workflow "
                                  "archive (.war)?")
        try:
            manifest = WorkflowManifest.from_json(
                _read_capped(path, MANIFEST_PATH, MAX_MANIFEST_BYTES),
                workflow_name=workflow_name or None)
        except WorkflowArchiverError as exc:
            raise InvalidWorkflow(str(exc)) from None
        spec_text = _read_member(directory, manifest.spec_file, "specFile", MAX_SPEC_BYTES)
        handler_source = _read_member(directory, manifest.handler, "handler",
                                      MAX_HANDLER_BYTES)
        spec = read_spec(spec_text, manifest.workflow_name, handler_source)
        return WorkflowArchive(url, manifest.workflow_name, directory, spec, spec_text,
                               manifest.handler, fetched)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise


def _read_capped(path: Path, shown: str, max_bytes: int) -> bytes:
    """The bytes of a file of the archive, InvalidWorkflow when it has more than
    ``max_bytes`` (never reading more than one byte beyond)."""
    with path.open("rb") as stream:
        data = stream.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InvalidWorkflow(f"the {shown} is over {max_bytes} bytes")
    return data


def _read_member(directory: Path, name: str, key: str, max_bytes: int) -> str:
    """A file the manifest names (a path inside the archive, as the manifest reader checked),
    of at most ``max_bytes``."""
    try:
        path = contained(name, directory)
    except UnsafePath as exc:
        raise InvalidWorkflow(f"the {key} {quoted(name)} {exc.why.value}") from None
    if not path.is_file():
        raise InvalidWorkflow(f"the archive has no {key} {quoted(name)}")
    data = _read_capped(path, f"{key} {quoted(name)}", max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidWorkflow(f"the {key} {quoted(name)} is not UTF-8 text") from None


def is_war(path: Path) -> bool:
    return path.is_file() and path.name.endswith(WAR_SUFFIX) and not path.name.startswith(".")


def list_store(store: Path) -> list[Path]:
    """Every workflow archive of the store (``load_workflows=all``), sorted by name."""
    return sorted(child for child in store.iterdir() if is_war(child))
