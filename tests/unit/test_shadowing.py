"""What a forked worker drops of the fork server's modules (backend/process/shadowing.py): those its
archive's folders shadow, as importlib's path finder finds them, but never a module a fresh
worker has imported before its archive's folder joins sys.path; and when dropping cannot make
it a fresh worker's equal (a kept module holds a shadowed one, or one has native code loaded),
why."""

from __future__ import annotations

import importlib
import importlib.machinery
import json
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.process.shadowing import FORK_SERVER_MODULES, drop, model_folders, refusal, shadowed
from tests.conftest import ROOT


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on sys.path standing for site-packages; what the test imports from it is
    forgotten afterwards."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    before = set(sys.modules)
    yield site
    for name in set(sys.modules) - before:
        del sys.modules[name]


def _write(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-P", "-c", f"{code}\nimport json, sys\n"
                          "from backend.process import worker\n"
                          "print(json.dumps(sorted(worker.STARTUP_MODULES)))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    return set(json.loads(out))


def test_the_fork_server_counts_as_a_workers_own_only_what_a_fresh_worker_imports() -> None:
    fresh = _modules_after("import backend.process.worker")
    forkserver = _modules_after("import backend.process.forkserver")
    assert "json" in fresh and "backend.service.model_service" in fresh
    # The fork server imports its own modules before the worker's: only built-in ones of
    # them (which nothing can shadow), and itself, may count as the worker's.
    assert forkserver - fresh - FORK_SERVER_MODULES <= set(sys.builtin_module_names)
    assert fresh <= forkserver


def test_an_archives_module_or_package_shadows_the_fork_servers_unless_the_worker_has_it(
        installed: Path, tmp_path: Path) -> None:
    _write(installed, {"shadowtest_pkg/__init__.py": "", "shadowtest_mod.py": "",
                       "shadowtest_kept.py": "", "shadowtest_ns/__init__.py": ""})
    for name in ("shadowtest_pkg", "shadowtest_mod", "shadowtest_kept", "shadowtest_ns",
                 "colorsys"):
        importlib.import_module(name)
    archive = tmp_path / "archive"
    _write(archive, {
        "shadowtest_pkg.py": "",  # a module shadows an installed package
        "shadowtest_mod/__init__.py": "",  # and a package an installed module
        "colorsys.py": "",  # a standard module the worker does not import itself
        "shadowtest_kept.py": "",  # one a fresh worker has imported already
        "shadowtest_ns/data.txt": "",  # a folder with no __init__.py: a namespace portion
        "sys.py": "", "unrelated.py": "",  # a built-in one; one nobody imported
    })
    folders = [str(archive)]
    assert shadowed(folders, {"shadowtest_kept"}) == ["colorsys", "shadowtest_mod",
                                                      "shadowtest_pkg"]
    # The fork server keeps no finder of the model's folder.
    assert str(archive) not in sys.path_importer_cache


def test_a_module_loaded_from_the_archives_own_file_is_not_shadowed(
        installed: Path) -> None:
    _write(installed, {"shadowtest_same.py": ""})
    importlib.import_module("shadowtest_same")
    assert shadowed([str(installed)], set()) == []


def test_the_folders_a_worker_puts_on_sys_path_are_foreseen(tmp_path: Path) -> None:
    _write(tmp_path, {"sub/handler.py": "", "MAR-INF/MANIFEST.json": json.dumps(
        {"model": {"handler": "sub/handler.py", "modelFile": "nets/net.py"}})})
    assert model_folders(str(tmp_path), "sub/handler.py:handle") == [
        str(tmp_path), str(tmp_path / "sub"), str(tmp_path / "nets")]
    outside = tmp_path / "elsewhere" / "service.py"
    _write(tmp_path, {"elsewhere/service.py": ""})
    bare = tmp_path / "bare"
    bare.mkdir()
    assert model_folders(str(bare), f"{outside}:handle") == [str(bare), str(outside.parent)]
    assert model_folders(str(bare), "image_classifier") == [str(bare)]


def test_drop_forgets_a_package_and_its_submodules_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("shadowtest_pkg", "shadowtest_pkg.sub", "shadowtest_pkgx"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    drop({"shadowtest_pkg"})
    assert "shadowtest_pkg" not in sys.modules and "shadowtest_pkg.sub" not in sys.modules
    assert "shadowtest_pkgx" in sys.modules


def test_a_kept_module_holding_a_shadowed_one_in_any_form_forbids_dropping_it(
        installed: Path) -> None:
    _write(installed, {
        "shadowtest_pkg/__init__.py": "class Thing:\n    pass\n\nTHING = Thing()\n\n"
                                      "def function():\n    pass\n",
        "shadowtest_pkg/sub.py": "import shadowtest_pkg\n",  # dropped with it: not a holder
        "shadowtest_h1.py": "import shadowtest_pkg\n",
        "shadowtest_h2.py": "from shadowtest_pkg import Thing\n",
        "shadowtest_h3.py": "from shadowtest_pkg import THING\n",
        "shadowtest_h4.py": "from shadowtest_pkg import function\n",
        # Its globals are looked at without running their code.
        "shadowtest_loud.py": "CALLS = []\n\nclass Loud:\n"
                              "    def __getattribute__(self, name):\n"
                              "        CALLS.append(name)\n"
                              "        return object.__getattribute__(self, name)\n\n"
                              "LOUD = Loud()\n",
    })
    for name in ("shadowtest_pkg.sub", "shadowtest_h1", "shadowtest_h2", "shadowtest_h3",
                 "shadowtest_h4", "shadowtest_loud"):
        importlib.import_module(name)
    assert refusal(["shadowtest_pkg"]) == (
        "its archive shadows shadowtest_pkg, which shadowtest_h1, shadowtest_h2, "
        "shadowtest_h3 and 1 more hold")
    assert refusal(["shadowtest_h4"]) == ""  # nothing holds it
    assert refusal(["shadowtest_loud"]) == "" and sys.modules["shadowtest_loud"].CALLS == []


def test_a_shadowed_package_with_native_code_loaded_cannot_be_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    package = types.ModuleType("shadowtest_native")
    package.__spec__ = importlib.machinery.ModuleSpec("shadowtest_native", None)
    native = types.ModuleType("shadowtest_native._speedups")
    native.__spec__ = importlib.machinery.ModuleSpec(
        native.__name__, importlib.machinery.ExtensionFileLoader(
            native.__name__, "/nowhere/_speedups.cpython.so"))
    monkeypatch.setitem(sys.modules, package.__name__, package)
    monkeypatch.setitem(sys.modules, native.__name__, native)
    assert refusal(["shadowtest_native"]) == (
        "its archive shadows shadowtest_native, whose native code "
        "(shadowtest_native._speedups) the fork server has loaded")
