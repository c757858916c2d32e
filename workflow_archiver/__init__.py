"""The ``workflow-archiver`` tool and the workflow archive (.war) format of TorchServe 0.12.

A .war is a zip holding a workflow's spec (YAML: its models and its DAG), a handler file of
Python functions (the DAG's function nodes), any extra files, and ``WAR-INF/MANIFEST.json``.
``workflow_archiver.spec`` reads and checks a spec as TorchServe does and
``workflow_archiver.manifest`` reads a manifest; both stay free of heavy imports (no torch),
so the frontend imports them as it imports ``model_archiver``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from workflow_archiver.errors import (
    InvalidDAGError,
    SpecError,
    WorkflowArchiverError,
    WorkflowManifestError,
)

__all__ = [
    "InvalidDAGError",
    "SpecError",
    "WorkflowArchiverError",
    "WorkflowManifestError",
    "__version__",
]

try:
    # One version for the whole distribution: the one in setup.py, as installed.
    __version__ = version("batchserve")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
