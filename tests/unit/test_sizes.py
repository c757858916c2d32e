"""Sizes in bounds (issue 32): no module over 600 lines, no function over 80.

Held here for the parts already brought in bounds: the frontend's ground floor (the config
package among it), its workflows, both archivers and the hand-written protos. A part joins
``SIZED`` once it is in bounds; the OpenAPI document (frontend/api/http/openapi.py) is the
one module allowed to be longer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
#: Files and folders (every .py below) held to the bounds.
SIZED = (
    "frontend/config", "frontend/settings.py", "frontend/errors.py", "frontend/tls.py",
    "frontend/processes.py", "frontend/torchserve_keys.py", "frontend/__init__.py",
    "frontend/workflows", "model_archiver", "workflow_archiver", "protos/framing.py",
    "protos/json_limits.py",
)


def _modules() -> list[Path]:
    found: list[Path] = []
    for entry in SIZED:
        path = ROOT / entry
        found.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return found


def _long_functions(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, length) of each function longer than MAX_FUNCTION_LINES."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1)
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno is not None
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


@pytest.mark.parametrize("path", _modules(), ids=lambda path: path.relative_to(ROOT).as_posix())
def test_module_and_its_functions_are_in_bounds(path: Path) -> None:
    source = path.read_text()
    lines = len(source.splitlines())
    assert lines <= MAX_MODULE_LINES, f"{lines} lines: split it by what it does"
    assert not _long_functions(source), "functions over 80 lines (name, line, length)"


def test_the_size_check_finds_a_long_function() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert _long_functions(f"def long():\n{body}") == [("long", 1, MAX_FUNCTION_LINES + 1)]
    assert _long_functions("def short():\n    pass\n") == []
    assert all(path.is_file() for path in _modules())
