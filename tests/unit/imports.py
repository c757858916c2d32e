"""Import state for tests that load handlers from their own model directories."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


def forget_modules(root: Path, *packages: str) -> None:
    """Forget every module imported from under ``root``, and the ``packages`` (with their
    submodules), so the next test imports them afresh."""
    for name, module in list(sys.modules.items()):
        origin = str(getattr(module, "__file__", None) or "")
        if origin.startswith(str(root)) or any(
                name == package or name.startswith(package + ".") for package in packages):
            del sys.modules[name]


@pytest.fixture
def restore_import_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Take each test's model directory off sys.path, and forget the modules loaded from it."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    forget_modules(tmp_path)
