"""Find, check and unpack model archives (.mar zip, .tar.gz, or a plain folder).

Archives come from the model store unless ``allowed_urls`` admits another location.
Every path an archive or a url names goes through ``model_archiver.paths.contained``:
extraction refuses absolute paths, ``..`` and links (zip-slip), and the files a manifest
names must lie inside the archive.
"""

from __future__ import annotations

import re
import shutil
import stat
import tarfile
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from frontend.errors import ArchiveError, Forbidden, excerpt, quoted
from model_archiver.manifest import MANIFEST_PATH, Manifest
from model_archiver.paths import Unsafe, UnsafePath, contained
from model_archiver.yaml_files import YamlError, read_yaml

ARCHIVE_SUFFIXES = (".mar", ".tar.gz", ".tgz")


@dataclass(frozen=True, slots=True)
class UnpackedArchive:
    url: str
    source: Path
    model_dir: Path
    manifest: Manifest
    manifest_json: str
    #: The archive's model-config.yaml (its frontend keys are read by the registry).
    model_config: dict[str, Any] = field(default_factory=dict)
    #: True when model_dir is our own extraction (removed on unregister).
    is_extracted: bool = True


def archive_stem(path: Path) -> str:
    name = path.name
    for suffix in ARCHIVE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


#: The ``allowed_urls`` of what the operator names (startup models, ``load_models``): any url.
OPERATOR_URLS = (".*",)


def require_allowed(url: str, allowed_urls: tuple[str, ...], shown: str | None = None) -> None:
    """Forbidden (403, saying how to admit it) unless a pattern of ``allowed_urls`` matches
    the whole ``url``; ``shown`` is how the message names it (default: the url)."""
    if not any(re.fullmatch(pattern, url) for pattern in allowed_urls):
        raise _not_allowed(url, quoted(url) if shown is None else shown)


def _not_allowed(url: str, shown: str) -> Forbidden:
    parts = urlsplit(url)
    if parts.scheme in ("http", "https") and parts.netloc:
        example = re.escape(f"{parts.scheme}://{parts.netloc}/") + ".*"
    else:
        example = re.escape(str(Path(parts.path or url).parent)) + "/.*"
    return Forbidden(
        f"url {shown} is not allowed: allowed_urls does not admit it (batchserve's default "
        "admits only the model store; TorchServe's admits any url). Admit a location with the "
        "config key allowed_urls, a comma-separated list of regular expressions that must "
        f"match the whole url, e.g. allowed_urls={excerpt(example)}")


def resolve_url(url: str, model_store: Path | None, allowed_urls: tuple[str, ...]) -> Path:
    """Map a register ``url`` to a local archive path, enforcing ``allowed_urls``.

    A bare name is looked up in the model store. An absolute path or ``file://`` URL must
    match one of the ``allowed_urls`` patterns in full (http(s) URLs are downloaded by
    frontend.models.download, which checks them itself).
    """
    if not url:
        raise ArchiveError("Parameter url is required.")
    parts = urlsplit(url)
    is_bare_name = not parts.scheme and "/" not in url and "\\" not in url
    if is_bare_name:
        if model_store is None:
            raise ArchiveError("no model store is configured (--model-store)")
        try:
            contained(url)  # a plain name: the store's entry itself, links and all
        except UnsafePath:
            raise ArchiveError(f"invalid model url {quoted(url)}") from None
        if url == ".":
            raise ArchiveError(f"invalid model url {quoted(url)}")
        path = model_store / url
        if not _exists(path):
            raise ArchiveError(f"Model archive {quoted(url)} not found in the model store "
                               f"{model_store}")
        return path
    if parts.scheme not in ("", "file"):
        require_allowed(url, allowed_urls)
        raise ArchiveError(f"unsupported url scheme {quoted(parts.scheme)}")
    raw_path = unquote(parts.path) if parts.scheme == "file" else url
    path = Path(raw_path)
    # A path inside the model store is the store's, as a bare name is (a multi-model
    # SageMaker endpoint sets model_store=/ and registers /opt/ml/models/<name>/model).
    if not _inside(path, model_store):
        require_allowed(url, allowed_urls)
    try:
        contained(raw_path, absolute=True)
    except UnsafePath as exc:
        if exc.why is Unsafe.PARENT:
            raise ArchiveError(f"invalid model url {quoted(url)}: '..' is not allowed") from None
        raise ArchiveError(f"invalid model url {quoted(url)}: it {exc.why.value}") from None
    if not _exists(path):
        raise ArchiveError(f"Model archive {quoted(url)} not found")
    return path


def _inside(path: Path, folder: Path | None) -> bool:
    """Whether ``path`` is absolute and, links resolved, lies in ``folder`` (or is it)."""
    if folder is None or not path.is_absolute():
        return False
    try:
        contained(path, folder, absolute=True)
    except UnsafePath:
        return False
    return True


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # e.g. a name too long for the file system
        raise ArchiveError(f"invalid model url: {quoted(path.name)}") from None


def _check_member(name: str, dest: Path) -> Path:
    try:
        return contained(name, dest)
    except UnsafePath as exc:
        raise ArchiveError(f"unsafe path in archive: {quoted(name)} {exc.why.value}") from None


def extract_zip(source: Path, dest: Path, kind: str = ".mar",
                max_unpacked_bytes: int | None = None) -> None:
    """Extract the zip ``source`` into ``dest``, refusing links and paths out of it, and
    (with ``max_unpacked_bytes``) more than that many bytes once unpacked, before any is
    written; ArchiveError (naming it a ``kind`` archive) when it is not a zip."""
    try:
        with zipfile.ZipFile(source) as archive:
            unpacked = 0
            for info in archive.infolist():
                mode = info.external_attr >> 16
                if stat.S_ISLNK(mode):
                    raise ArchiveError(f"links are not allowed in archives: "
                                       f"{quoted(info.filename)}")
                _check_member(info.filename, dest)
                # zipfile never unpacks a member beyond the size the archive declares for it.
                unpacked += info.file_size
            if max_unpacked_bytes is not None and unpacked > max_unpacked_bytes:
                raise ArchiveError(f"{excerpt(source.name)} unpacks to {unpacked} bytes, over "
                                   f"the limit of {max_unpacked_bytes} for a {kind} archive")
            archive.extractall(dest)
    except zipfile.BadZipFile as exc:
        raise ArchiveError(f"{source.name} is not a valid {kind} (zip) archive: {exc}") from exc
    except (OSError, IndexError, ValueError) as exc:  # clashing, empty or too-long names
        raise ArchiveError(f"{source.name} has entries that cannot be unpacked: {exc}") from exc


def _extract_tar(source: Path, dest: Path) -> None:
    try:
        with tarfile.open(source, "r:*") as archive:
            for member in archive.getmembers():
                if not (member.isfile() or member.isdir()):
                    raise ArchiveError(f"only files and folders are allowed: {quoted(member.name)}")
                _check_member(member.name, dest)
            archive.extractall(dest, filter="data")
    except tarfile.TarError as exc:
        raise ArchiveError(f"{source.name} is not a valid tar.gz archive: {exc}") from exc
    except (OSError, IndexError, ValueError) as exc:
        raise ArchiveError(f"{source.name} has entries that cannot be unpacked: {exc}") from exc


def _manifest_root(extracted: Path) -> Path:
    """The folder that holds MAR-INF: the extraction itself, or its single top folder (tgz)."""
    if (extracted / MANIFEST_PATH).is_file():
        return extracted
    children = [child for child in extracted.iterdir()]
    if len(children) == 1 and children[0].is_dir() and (children[0] / MANIFEST_PATH).is_file():
        return children[0]
    return extracted


def _read_manifest(model_dir: Path, default_name: str) -> tuple[Manifest, str]:
    path = model_dir / MANIFEST_PATH
    if not path.is_file():
        # TorchServe synthesises a manifest for archives without one.
        manifest = Manifest(model_name=default_name, model_version="1.0", handler="")
        return manifest, manifest.to_json()
    try:
        text = path.read_text(encoding="utf-8")
        return Manifest.from_json(text), text
    except Exception as exc:
        raise ArchiveError(f"invalid {MANIFEST_PATH}: {excerpt(str(exc), 300)}") from exc


def check_handler(handler: str, given_as: str = "its handler") -> None:
    """A handler (the manifest's, or a register request's ``handler`` parameter) that names
    a file names one inside the model: the worker looks for the part before ``:`` (``.py``
    added) in the model's folder. ArchiveError otherwise, naming it ``given_as``.
    (``default_service_handler``, the operator's, may name a file anywhere.)"""
    module = handler.partition(":")[0].strip()
    if module:
        _check_named(given_as, module)


def _check_named(key: str, name: str) -> None:
    """A file the manifest names (``key``) is a path inside the archive: not absolute, no
    ``..``. The worker reads it where it is, following the model folder's own links (a
    folder in the store may link its weights from a cache)."""
    try:
        contained(name)
    except UnsafePath as exc:
        raise ArchiveError(f"unsafe path in archive: {key} {quoted(name)} "
                           f"{exc.why.value}") from None


def _check_manifest_files(manifest: Manifest) -> None:
    check_handler(manifest.handler)
    for key, name in (("serializedFile", manifest.serialized_file),
                      ("modelFile", manifest.model_file),
                      ("requirementsFile", manifest.requirements_file),
                      ("configFile", manifest.config_file)):
        if name:
            _check_named(f"its {key}", name)


def _read_model_config(model_dir: Path, manifest: Manifest) -> dict[str, Any]:
    if not manifest.config_file:
        return {}
    try:
        # Read here, by the server: its links too must stay inside the model's folder.
        path = contained(manifest.config_file, model_dir)
    except UnsafePath as exc:
        raise ArchiveError(f"unsafe path in archive: its configFile "
                           f"{quoted(manifest.config_file)} {exc.why.value}") from None
    shown = excerpt(manifest.config_file)
    try:
        if not path.is_file():
            raise ArchiveError(f"the archive names config file {quoted(manifest.config_file)} "
                               "but has none")
        loaded = read_yaml(path)
    except YamlError as exc:
        raise ArchiveError(f"invalid {shown}: {exc}") from None
    except OSError as exc:
        raise ArchiveError(f"cannot read {shown}: {exc.strerror}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ArchiveError(f"{shown} must hold a mapping")
    return loaded


def unpack(url: str, source: Path, work_dir: Path) -> UnpackedArchive:
    """Unpack ``source`` under ``work_dir`` (a folder is used in place) and read its manifest."""
    if source.is_dir():
        model_dir, is_extracted = source.resolve(), False
    else:
        if not source.name.endswith(ARCHIVE_SUFFIXES):
            raise ArchiveError(f"{source.name}: expected a .mar, .tar.gz or .tgz archive")
        dest = (work_dir / f"{archive_stem(source)}-{uuid.uuid4().hex[:8]}").resolve()
        dest.mkdir(parents=True, mode=0o700)
        try:
            if source.name.endswith(".mar"):
                extract_zip(source, dest)
            else:
                _extract_tar(source, dest)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        model_dir, is_extracted = _manifest_root(dest), True
    try:
        manifest, manifest_json = _read_manifest(model_dir, archive_stem(source))
        _check_manifest_files(manifest)
        model_config = _read_model_config(model_dir, manifest)
    except BaseException:
        if is_extracted:
            shutil.rmtree(model_dir, ignore_errors=True)
        raise
    return UnpackedArchive(url, source, model_dir, manifest, manifest_json, model_config,
                           is_extracted)


def remove_unpacked(archive: UnpackedArchive, work_dir: Path) -> None:
    """Delete our extraction of an archive (never a user's folder)."""
    if not archive.is_extracted:
        return
    top = archive.model_dir
    while top.parent != work_dir.resolve() and work_dir.resolve() in top.parents:
        top = top.parent
    shutil.rmtree(top, ignore_errors=True)


def list_store(model_store: Path) -> list[Path]:
    """Every loadable entry of the model store (``load_models=all``), sorted by name."""
    entries = []
    for child in sorted(model_store.iterdir()):
        if child.name.startswith("."):
            continue
        if child.is_file() and child.name.endswith(ARCHIVE_SUFFIXES):
            entries.append(child)
        elif child.is_dir() and (child / MANIFEST_PATH).is_file():
            entries.append(child)
    return entries
