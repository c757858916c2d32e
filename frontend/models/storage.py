"""Vertex AI's model storage (``AIP_STORAGE_URI``) as a local model store holding
``model.mar``, as Google's prebuilt PyTorch image finds it: the archive right under the URI.

* ``gs://bucket/folder``: ``folder/model.mar`` downloaded with Google's storage client library
  (``google-cloud-storage``, batchserve's ``vertex`` extra, imported only here and only then)
  into a fresh private folder. Its credentials are the container's (on Vertex AI, the
  deployed model's service account), found by the library as it always finds them.
* a local folder (a path, or a ``file://`` URI): used as it is (a volume mounted where a
  test, or another platform, put the model).

Blocking: called once at start, before the server exists.
"""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlsplit

from frontend.config.vertex import ARCHIVE
from frontend.errors import ConfigError

#: How to install the library a ``gs://`` URI needs.
INSTALL_HINT = "pip install 'batchserve[vertex]' (google-cloud-storage)"


def model_folder(uri: str, download_root: Path | None = None) -> Path:
    """A local folder holding ``model.mar`` for ``AIP_STORAGE_URI``; ConfigError saying what
    is missing (the library, the archive, access to it)."""
    parts = urlsplit(uri)
    if parts.scheme == "gs":
        return _download(parts.netloc, parts.path.strip("/"), uri, download_root)
    if parts.scheme == "file":
        folder = Path(unquote(parts.path))
    elif parts.scheme:
        raise ConfigError(f"AIP_STORAGE_URI={uri!r}: expected gs://bucket/folder or a local "
                          "folder")
    else:
        folder = Path(uri)
    if not (folder / ARCHIVE).is_file():
        raise ConfigError(f"AIP_STORAGE_URI={uri!r}: no {ARCHIVE} in {folder} (Vertex AI's "
                          f"prebuilt PyTorch image serves the {ARCHIVE} right under the "
                          "model's artifact URI)")
    return folder


def _download(bucket_name: str, prefix: str, uri: str, download_root: Path | None) -> Path:
    if not bucket_name:
        raise ConfigError(f"AIP_STORAGE_URI={uri!r}: no bucket")
    try:
        storage = importlib.import_module("google.cloud.storage")
    except ImportError as exc:
        raise ConfigError(f"AIP_STORAGE_URI={uri!r} is in Google Cloud Storage, which needs "
                          f"Google's storage client library: {INSTALL_HINT} ({exc})") from None
    name = f"{prefix}/{ARCHIVE}" if prefix else ARCHIVE
    folder = Path(tempfile.mkdtemp(prefix="batchserve-vertex-", dir=download_root))
    try:
        client = storage.Client()
        client.bucket(bucket_name).blob(name).download_to_filename(str(folder / ARCHIVE))
    except Exception as exc:  # the library's own errors (NotFound, Forbidden, credentials)
        raise ConfigError(f"cannot download gs://{bucket_name}/{name} (AIP_STORAGE_URI): "
                          f"{type(exc).__name__}: {exc}") from None
    return folder
