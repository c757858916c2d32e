"""What the fork server imports before forking a model's worker (backend/process/preload.py): the
modules its handler is known to need, only among those known to be safe to import before a
fork, never the archive's own."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from backend.process.preload import is_fork_safe, modules_for, modules_for_archive


def test_a_built_in_handler_preloads_its_module() -> None:
    assert modules_for("image_classifier", "/nonexistent") == [
        "backend.handlers.image_classifier"]


def test_a_torchserve_handler_name_preloads_its_ts_module_when_it_is_safe() -> None:
    assert modules_for("densenet_handler", "/nonexistent") == [
        "ts.torch_handler.densenet_handler"]
    assert modules_for("vllm_handler", "/nonexistent") == []  # imports vLLM


def test_a_handler_file_preloads_its_fork_safe_top_level_imports_only(tmp_path: Path) -> None:
    (tmp_path / "handler.py").write_text(
        "import os\n"
        "import torch.nn as nn\n"
        "import numpy, transformers\n"
        "from torchvision import transforms\n"
        "from ts.torch_handler.base_handler import BaseHandler\n"
        "from ts.torch_handler.vllm_handler import VLLMHandler\n"
        "from . import sibling\n"
        "from PIL import Image\n"
        "def later():\n"
        "    import torchaudio\n")
    assert modules_for("handler.py:handle", str(tmp_path)) == [
        "torch.nn", "numpy", "torchvision", "ts.torch_handler.base_handler", "PIL"]


def test_a_module_the_archive_itself_holds_is_never_preloaded(tmp_path: Path) -> None:
    (tmp_path / "handler.py").write_text("import torch\nimport numpy\n")
    (tmp_path / "numpy").mkdir()  # the archive's numpy: the worker imports it, not ours
    assert modules_for("handler", str(tmp_path)) == ["torch"]


def test_an_unreadable_or_broken_handler_file_preloads_nothing(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("import torch\ndef broken(:\n")
    assert modules_for("broken.py", str(tmp_path)) == []
    assert modules_for("", str(tmp_path)) == []
    assert modules_for("missing.py", str(tmp_path)) == []


def test_fork_safety_is_known_of_a_few_packages_only() -> None:
    assert is_fork_safe("torch") and is_fork_safe("torchvision.transforms")
    assert is_fork_safe("ts.torch_handler.image_classifier")
    assert not is_fork_safe("transformers") and not is_fork_safe("ts.torch_handler.dali_handler")
    assert not is_fork_safe("torchaudio")


def _manifest(handler: str) -> str:
    return json.dumps({"model": {"modelName": "m", "handler": handler}})


def test_an_archive_not_unpacked_yet_is_read_for_its_handlers_imports(tmp_path: Path) -> None:
    # The startup models' archives, read by the fork server started before they are unpacked:
    # a .mar file, as the unpacked archive would be read.
    archive = tmp_path / "m.mar"
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.writestr("MAR-INF/MANIFEST.json", _manifest("my_handler.py:handle"))
        zipped.writestr("my_handler.py", "import torch\nimport numpy\nimport helpers\n"
                                         "import transformers\nfrom PIL import Image\n")
        zipped.writestr("numpy/__init__.py", "")  # the archive's own numpy: not preloaded
    assert modules_for_archive(archive) == ["torch", "PIL"]
    folder = tmp_path / "folder"
    (folder / "MAR-INF").mkdir(parents=True)
    (folder / "MAR-INF" / "MANIFEST.json").write_text(_manifest("image_classifier"))
    assert modules_for_archive(folder) == ["backend.handlers.image_classifier"]


def test_an_archive_that_cannot_be_read_preloads_nothing(tmp_path: Path) -> None:
    broken = tmp_path / "broken.mar"
    broken.write_bytes(b"PK\x03\x04 not really a zip")
    no_manifest = tmp_path / "bare.mar"
    with zipfile.ZipFile(no_manifest, "w") as zipped:
        zipped.writestr("handler.py", "import torch\n")
    not_json = tmp_path / "bad.mar"
    with zipfile.ZipFile(not_json, "w") as zipped:
        zipped.writestr("MAR-INF/MANIFEST.json", "{")
    for archive in (broken, no_manifest, not_json, tmp_path / "missing.mar", tmp_path):
        assert modules_for_archive(archive) == []
