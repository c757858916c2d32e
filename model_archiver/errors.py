"""Errors raised by the model archiver.

Library code raises these; only the CLI turns them into an exit status.
"""

from __future__ import annotations

__all__ = ["ManifestError", "ModelArchiverError"]


class ModelArchiverError(Exception):
    """An archive could not be built or read; the message is meant for the user."""


class ManifestError(ModelArchiverError):
    """A ``MAR-INF/MANIFEST.json`` is missing, unreadable or lacks a required field."""
