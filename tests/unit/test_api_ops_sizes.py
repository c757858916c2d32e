"""Sizes in the transports and use-cases (frontend/api/, frontend/ops/): no module over 600
lines but the OpenAPI document (frontend/api/http/openapi.py: data, not logic), no function
over 80 (issue 32)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
FOLDERS = ("frontend/api", "frontend/ops")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
#: Modules allowed past MAX_MODULE_LINES, and why.
LONG_MODULES = {"frontend/api/http/openapi.py": "the OpenAPI documents: data, not logic"}


def _modules() -> list[Path]:
    return sorted(path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py"))


def _long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    return [(node.name, node.end_lineno - node.lineno + 1)
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > limit]


@pytest.mark.parametrize("path", _modules(), ids=lambda path: str(path.relative_to(ROOT)))
def test_modules_and_functions_stay_small(path: Path) -> None:
    source = path.read_text()
    name = str(path.relative_to(ROOT))
    if name not in LONG_MODULES:
        assert len(source.splitlines()) <= MAX_MODULE_LINES, name
    assert _long_functions(source, MAX_FUNCTION_LINES) == [], name


def test_the_size_check_finds_a_long_function() -> None:
    body = "\n".join(f"    x = {n}" for n in range(MAX_FUNCTION_LINES))
    assert _long_functions(f"def f():\n{body}\n", MAX_FUNCTION_LINES) == [
        ("f", MAX_FUNCTION_LINES + 1)]
