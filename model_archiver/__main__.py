"""``python -m model_archiver`` runs the ``model-archiver`` CLI."""

from __future__ import annotations

from model_archiver.cli import main

if __name__ == "__main__":
    main(prog_name="model-archiver")
