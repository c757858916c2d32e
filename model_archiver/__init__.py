"""The ``model-archiver`` tool and the model archive (.mar) format.

``model_archiver.manifest`` is also the reader the frontend uses for archives in the model
store, so it must stay free of heavy imports (no torch).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from model_archiver.errors import ManifestError, ModelArchiverError

__all__ = ["ManifestError", "ModelArchiverError", "__version__"]

try:
    # Single source of truth: the version in setup.py, as installed.
    __version__ = version("batchserve")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
