"""TorchServe's micro-batching (``ts.handler_utils.micro_batching``) in a real server: an
ImageClassifier handler set up as TorchServe's ``examples/micro_batching`` does, archived by
TorchServe's own torch-model-archiver 0.12 with a model-config.yaml, serves one batch of 8
as 4 micro-batches whose steps overlap."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.compat.test_torchserve_archives import TS_ARCHIVER, torchserve_archive
from tests.conftest import ROOT

TS_HANDLERS = ROOT / "tests" / "fixtures" / "ts_handlers"
BATCH = 8
MICRO_BATCH = 2
WORK_S = 0.15

pytestmark = pytest.mark.skipif(not TS_ARCHIVER.exists(),
                                reason="run `make test` to install torch-model-archiver 0.12")

CONFIG = f"""\
batchSize: {BATCH}
micro_batching:
  micro_batch_size: {MICRO_BATCH}
  parallelism:
    preprocess: 2
    inference: 1
    postprocess: 2
handler:
  simulated_work_s: {WORK_S}
"""


def overlaps(a: list[float], b: list[float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_micro_batches_of_one_batch_overlap_their_steps(model_store: Path,
                                                        start_server) -> None:
    from tests.integration.vision_fixtures import LABELS, jpeg, tiny_model_files

    model_file, weights, labels = tiny_model_files(model_store / "src")
    config = model_store / "src" / "model-config.yaml"
    config.write_text(CONFIG)
    torchserve_archive(model_store, "tsmicro", "--model-file", str(model_file),
                       "--serialized-file", str(weights),
                       "--handler", str(TS_HANDLERS / "micro_batching_classifier.py"),
                       "--extra-files", str(labels), "--config-file", str(config))
    server = start_server()
    requests.post(f"{server.management}/models", params={
        "url": "tsmicro.mar", "batch_size": BATCH, "max_batch_delay": 5000,
        "batch_policy": "fixed", "initial_workers": 1, "synchronous": "true"},
        timeout=120).raise_for_status()

    with ThreadPoolExecutor(BATCH) as pool:
        answers = list(pool.map(lambda seed: server.predict("tsmicro", jpeg(seed)),
                                range(BATCH)))

    assert [a.status_code for a in answers] == [200] * BATCH, [a.text for a in answers]
    assert server.describe("tsmicro")["batching"]["recentBatchSizes"] == [BATCH]
    bodies = [answer.json() for answer in answers]
    for body in bodies:
        assert set(body["labels"]) <= {label for _, label in LABELS.values()}
    # The batch went through in BATCH / MICRO_BATCH micro-batches of MICRO_BATCH images.
    members: dict[int, int] = {}
    for body in bodies:
        members[body["micro_batch"]] = members.get(body["micro_batch"], 0) + 1
    assert members == {index: MICRO_BATCH for index in range(BATCH // MICRO_BATCH)}
    spans = {body["micro_batch"]: body["spans"] for body in bodies}
    # While one micro-batch was in inference, another was being preprocessed.
    overlapping = [(i, j) for i in spans for j in spans
                   if i != j and overlaps(spans[i]["inference"], spans[j]["preprocess"])]
    assert overlapping, spans
    # Sequentially the steps would take 2 * WORK_S per micro-batch; overlapped, far less.
    first = min(span["preprocess"][0] for span in spans.values())
    last = max(span["inference"][1] for span in spans.values())
    assert last - first < 2 * WORK_S * len(spans) - WORK_S / 2, spans
    # Postprocessing ran on threads of its own, not on the worker's main thread.
    assert "MainThread" not in {body["thread"] for body in bodies}
