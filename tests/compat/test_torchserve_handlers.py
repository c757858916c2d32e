"""TorchServe custom handlers (``import ts``), archived by TorchServe's own
torch-model-archiver 0.12, serve over HTTP from our worker through its ``ts`` shim."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.compat.test_torchserve_archives import TS_ARCHIVER, torchserve_archive
from tests.conftest import ROOT

TS_HANDLERS = ROOT / "tests" / "fixtures" / "ts_handlers"

pytestmark = pytest.mark.skipif(not TS_ARCHIVER.exists(),
                                reason="run `make test` to install torch-model-archiver 0.12")


def test_image_classifier_subclass_serves_over_http(model_store: Path, start_server) -> None:
    from tests.integration.vision_fixtures import LABELS, jpeg, tiny_model_files

    model_file, weights, labels = tiny_model_files(model_store / "src")
    torchserve_archive(model_store, "tscustom", "--model-file", str(model_file),
                       "--serialized-file", str(weights),
                       "--handler", str(TS_HANDLERS / "custom_classifier.py"),
                       "--extra-files", str(labels))
    server = start_server("tscustom.mar")

    answer = server.predict("tscustom", jpeg(5))

    assert answer.status_code == 200, answer.text
    (label, probability), = answer.json().items()  # the handler keeps the top class only
    assert label in {name for _, name in LABELS.values()}
    assert 1 / 3 <= probability <= 1


def test_prediction_exception_status_reaches_the_client(model_store: Path, start_server) -> None:
    torchserve_archive(model_store, "tsteapot", "--handler", str(TS_HANDLERS / "teapot.py"))
    server = start_server("tsteapot.mar")

    refused = server.predict("tsteapot", b"teapot")
    served = server.predict("tsteapot", b"coffee")

    assert refused.status_code == 418, refused.text
    assert refused.json()["message"] == "I'm a teapot, not a coffee machine"
    assert (served.status_code, served.content) == (200, b"coffee")


def test_one_corrupt_image_fails_only_its_own_request_in_a_batch(
        model_store: Path, start_server) -> None:
    import requests

    from tests.integration.vision_fixtures import LABELS, jpeg, tiny_model_files

    model_file, weights, labels = tiny_model_files(model_store / "src")
    torchserve_archive(model_store, "tsbatch", "--model-file", str(model_file),
                       "--serialized-file", str(weights),
                       "--handler", str(TS_HANDLERS / "custom_classifier.py"),
                       "--extra-files", str(labels))
    server = start_server()
    requests.post(f"{server.management}/models", params={
        "url": "tsbatch.mar", "batch_size": 4, "max_batch_delay": 5000, "batch_policy": "fixed",
        "initial_workers": 1, "synchronous": "true"}, timeout=120).raise_for_status()
    bodies = [jpeg(3), jpeg(4), b"not an image at all", jpeg(5)]

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda body: server.predict("tsbatch", body), bodies))

    # The four rode in one batch, which the handler failed as a whole (TorchServe answers all
    # four with the bad image's error); here only the bad image is refused.
    assert server.describe("tsbatch")["batching"]["recentBatchSizes"] == [4]
    assert [a.status_code for a in answers] == [200, 200, 400, 200], [a.text for a in answers]
    assert "not an image" in answers[2].json()["message"]
    for answer in (answers[0], answers[1], answers[3]):
        (label, _), = answer.json().items()
        assert label in {name for _, name in LABELS.values()}
