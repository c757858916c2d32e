"""``python -m workflow_archiver`` runs the ``workflow-archiver`` CLI."""

from __future__ import annotations

from workflow_archiver.cli import main

if __name__ == "__main__":
    main(prog_name="workflow-archiver")
