"""Archives made by TorchServe's own torch-model-archiver 0.12 register and serve here.

TorchServe's archiver lives in its own venv (`make test` creates it): its Python package is
also called ``model_archiver``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import requests

from tests.conftest import HANDLERS, ROOT

TS_ARCHIVER = ROOT / ".venv-torchserve-archiver" / "bin" / "torch-model-archiver"

pytestmark = pytest.mark.skipif(not TS_ARCHIVER.exists(),
                                reason="run `make test` to install torch-model-archiver 0.12")


def torchserve_archive(store: Path, name: str, *args: str, fmt: str = "default") -> None:
    # Without PYTHONPATH: our model_archiver package shares TorchServe's package name.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    subprocess.run([str(TS_ARCHIVER), "--model-name", name, "--version", "1.0",
                    "--export-path", str(store), "--archive-format", fmt, *args],
                   check=True, capture_output=True, timeout=120, cwd=store, env=env)


@pytest.mark.parametrize("fmt", ["default", "tgz", "no-archive"])
def test_module_level_handle_function_archive(model_store: Path, start_server, fmt: str) -> None:
    torchserve_archive(model_store, "tsecho", "--handler", str(HANDLERS / "echo.py"), fmt=fmt)
    url = {"default": "tsecho.mar", "tgz": "tsecho.tar.gz", "no-archive": "tsecho"}[fmt]
    server = start_server()
    registered = requests.post(f"{server.management}/models",
                               params={"url": url, "batch_size": 4, "max_batch_delay": 10,
                                       "initial_workers": 1, "synchronous": "true"}, timeout=60)
    assert registered.status_code == 200, registered.text
    assert server.predict("tsecho", b"made by torchserve").content == b"made by torchserve"
    assert server.describe("tsecho")["modelVersion"] == "1.0"


def test_image_classifier_archive(model_store: Path, start_server) -> None:
    from tests.integration.vision_fixtures import LABELS, jpeg, tiny_model_files

    model_file, weights, labels = tiny_model_files(model_store / "src")
    torchserve_archive(model_store, "tstiny", "--model-file", str(model_file),
                       "--serialized-file", str(weights), "--handler", "image_classifier",
                       "--extra-files", str(labels))
    server = start_server("tstiny.mar")
    answer = server.predict("tstiny", jpeg(5))
    assert answer.status_code == 200, answer.text
    assert set(answer.json()) == {label for _, label in LABELS.values()}


# ---- --handler: what TorchServe's archiver takes, ours takes ----------------------------------

#: --handler values, given in a folder that holds h.py, sub/h2.py and image_classifier.py (a
#: built-in's bare name does not reach that file; ``image_classifier:handle`` does).
HANDLER_SPELLINGS = [
    "image_classifier", "base_handler", "vllm_handler", "dali_image_classifier",
    "image_clasifier", "densenet_handler", "ts.torch_handler.image_classifier",
    "image_classifier:handle", "module:fn", "missing.py", "xyz/abc", "h", "h:fn", "h.py",
    "./h.py", "sub/h2", "sub/h2:fn",
]


def test_the_builtin_handlers_are_torchserves() -> None:
    """The names torch-model-archiver 0.12 takes as built-ins (its ``model_handlers``)."""
    import ast

    from model_archiver.handlers import BUILTIN_HANDLERS

    source = next(TS_ARCHIVER.parent.parent.glob(
        "lib/python*/site-packages/model_archiver/model_packaging_utils.py"))
    tree = ast.parse(source.read_text())
    table = next(node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and [ast.unparse(t) for t in node.targets] == ["model_handlers"])
    assert set(ast.literal_eval(table)) == BUILTIN_HANDLERS


def test_handlers_are_taken_and_refused_as_torchserves_archiver_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each spelling is taken by both archivers, recorded alike, or refused by both. (Ours
    also takes ``h.py:fn``, which TorchServe's looks for as a file of that name, and refuses
    an empty value, which TorchServe's writes: model_archiver/handlers.py.)"""
    from concurrent.futures import ThreadPoolExecutor

    from model_archiver.errors import ModelArchiverError
    from model_archiver.manifest import read_manifest
    from model_archiver.packaging import ArchiveOptions, build_archive

    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    for file in ("h.py", "sub/h2.py", "image_classifier.py"):
        (work / file).write_text("def fn(data, context):\n    return data\n")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}

    def theirs(index: int) -> str | None:
        out = tmp_path / f"ts{index}"
        (out / "tmp").mkdir(parents=True)
        # A TMPDIR each: TorchServe's archiver gathers the files in $TMPDIR/<model name>.
        done = subprocess.run([str(TS_ARCHIVER), "--model-name", "m", "--version", "1",
                               "--handler", HANDLER_SPELLINGS[index], "--export-path", str(out)],
                              capture_output=True, timeout=120, cwd=work,
                              env={**env, "TMPDIR": str(out / "tmp")}, check=False)
        return read_manifest(out / "m.mar").handler if done.returncode == 0 else None

    with ThreadPoolExecutor(4) as pool:
        torchserve = list(pool.map(theirs, range(len(HANDLER_SPELLINGS))))
    monkeypatch.chdir(work)
    for index, handler in enumerate(HANDLER_SPELLINGS):
        out = tmp_path / f"ours{index}"
        out.mkdir()
        try:
            ours: str | None = read_manifest(build_archive(ArchiveOptions(
                model_name="m", version="1", handler=handler, export_path=out))).handler
        except ModelArchiverError:
            ours = None
        assert ours == torchserve[index], handler
    refused = {handler for handler, theirs in zip(HANDLER_SPELLINGS, torchserve, strict=True)
               if theirs is None}
    assert refused == {"image_clasifier", "densenet_handler", "module:fn", "missing.py",
                       "xyz/abc", "ts.torch_handler.image_classifier"}
