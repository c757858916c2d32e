"""docs/architecture.md names only what exists (issue 32): every repository path it names is
a tracked file or folder, a path it gives relative to a package (``ops/plane.py``,
``api/http/kserve.py``) is one below ``frontend/`` or ``backend/``, and every module it names
bare (`` `plane.py` ``) exists somewhere in the tree."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent.parent.parent
DOC = ROOT / "docs" / "architecture.md"
TOP = ("frontend/", "backend/", "protos/", "model_archiver/", "workflow_archiver/", "tests/",
       "docs/", "benchmarks/", "docker/", "deploy/", "examples/")
#: Names the document gives that are not files of this repository: what an archive holds.
NOT_REPOSITORY_FILES = {"model-config.yaml", "MANIFEST.json", "index_to_name.json",
                        "setup_config.json"}
#: A path: names joined by "/", ending in a file name with a suffix or in "/".
_PATH = re.compile(r"(?<![\w./:-])((?:[\w-]+/)+(?:[\w-]+\.(?:py|md|html|yaml|proto|json|sh)"
                   r"|(?=[\s`),;:])))")
_BARE = re.compile(r"`([\w-]+\.(?:py|md|html|yaml|proto|json|sh))`")


def _tracked() -> tuple[set[str], set[str]]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    files = set(listed)
    folders = {str(parent) + "/" for name in listed
               for parent in PurePosixPath(name).parents if str(parent) != "."}
    return files, folders


def _exists(path: str, files: set[str], folders: set[str]) -> bool:
    if path in files or path in folders:
        return True
    if path.startswith(TOP):
        return False
    # Relative to a package: frontend/<path> or backend/<path> (the diagram's "ops/plane.py").
    return any(f"{package}/{path}" in files or f"{package}/{path}" in folders
               for package in ("frontend", "backend", "frontend/api", "backend/compat"))


def test_every_path_the_architecture_names_exists() -> None:
    files, folders = _tracked()
    text = DOC.read_text()
    named = set(_PATH.findall(text))
    assert len(named) > 40  # the check reads the document's paths
    missing = sorted(path for path in named if not _exists(path, files, folders))
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_module_the_architecture_names_exists() -> None:
    files, _ = _tracked()
    names = {PurePosixPath(name).name for name in files}
    named = set(_BARE.findall(DOC.read_text())) - NOT_REPOSITORY_FILES
    assert len(named) > 40
    missing = sorted(name for name in named if name not in names)
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_the_check_finds_a_missing_path() -> None:
    files, folders = _tracked()
    assert _exists("frontend/ops/plane.py", files, folders)
    assert _exists("ops/plane.py", files, folders)
    assert not _exists("frontend/workflows/dag.py", files, folders)
    assert not _exists("workflows/dag.py", files, folders)
    assert _PATH.findall("see `frontend/workflows/dag.py` and api/http/ then") == [
        "frontend/workflows/dag.py", "api/http/"]
