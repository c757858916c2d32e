"""The serving core and its observers stay in tighter bounds than the rest (issue 32;
tests/unit/test_layout.py holds every module to 600 lines and every function to 80): the
batcher within 500 lines, and no class over 400 in frontend/serving, frontend/observe or
frontend/models (the largest, the two batchers, hold a queue's every decision)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
FOLDERS = ("frontend/serving", "frontend/observe", "frontend/models")
MAX_BATCHER_LINES = 500
MAX_CLASS_LINES = 400


def _modules() -> Iterator[Path]:
    for folder in FOLDERS:
        yield from sorted((ROOT / folder).glob("*.py"))


def _lines(node: ast.AST) -> int:
    return (node.end_lineno or node.lineno) - node.lineno + 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", list(_modules()), ids=lambda path: path.name)
def test_a_module_is_in_bounds(path: Path) -> None:
    text = path.read_text()
    if path.name == "batching.py":
        assert len(text.splitlines()) <= MAX_BATCHER_LINES, f"{path}: over 500 lines"
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.ClassDef):
            assert _lines(node) <= MAX_CLASS_LINES, \
                f"{path}:{node.lineno} {node.name} has {_lines(node)} lines"


def test_the_bounds_are_checked_where_they_were_broken() -> None:
    names = {path.name for path in _modules()}
    assert {"batching.py", "workers.py", "metrics.py", "model.py"} <= names
    tree = ast.parse("def f():\n" + "    x = 1\n" * 100)
    assert _lines(tree.body[0]) == 101
