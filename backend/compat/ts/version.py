"""``ts.version``: the TorchServe release whose ``ts`` API this package provides."""

from __future__ import annotations

from pathlib import Path

#: The file holding the version, as in TorchServe's package.
version_path = str(Path(__file__).resolve().parent / "version.txt")

__version__ = Path(version_path).read_text(encoding="utf-8").strip()
