"""Errors raised by the workflow archiver and the spec reader.

Library code raises these; the CLI turns them into an exit status, the server into a response.
Each says what TorchServe 0.12 raises for the same fault, so that the server can answer as it
does where it wants to (``torchserve_type``, the ``type`` of TorchServe's error body).
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["InvalidDAGError", "SpecError", "WorkflowArchiverError", "WorkflowManifestError"]


class WorkflowArchiverError(Exception):
    """A workflow archive could not be built or read; the message is meant for the user."""

    torchserve_type: ClassVar[str] = "WorkflowException"


class WorkflowManifestError(WorkflowArchiverError):
    """``WAR-INF/MANIFEST.json`` is missing, unreadable, or lacks what TorchServe requires.

    TorchServe raises ``InvalidWorkflowException`` (500 at registration) with the messages
    quoted in ``workflow_archiver.manifest``.
    """

    torchserve_type = "InvalidWorkflowException"


class SpecError(WorkflowArchiverError):
    """The workflow spec is not one TorchServe 0.12 would register.

    TorchServe reports an unparsable spec as ``InvalidWorkflowException`` ("Failed to parse
    yaml.", a 500), and most other faults of shape (a section that is not a mapping, a setting
    that is not an integer, a model without ``url``) only as a ``NullPointerException`` or
    ``ClassCastException`` (a 500 without a useful message) or as a node that fails to
    register; this reader names the section, the node and the key instead.
    """

    torchserve_type = "InvalidWorkflowException"


class InvalidDAGError(SpecError):
    """The ``dag`` section is not a DAG TorchServe accepts: TorchServe's
    ``InvalidDAGException``, which its register API answers with 400 and the exception's
    message (``"DAG should have only one start node"``, ``"Not a valid DAG"``,
    ``"Self loop exception"``, ``"loop exception"``). Our messages begin with TorchServe's and
    add which nodes."""

    torchserve_type = "InvalidDAGException"
