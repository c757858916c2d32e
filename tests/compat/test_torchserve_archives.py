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
