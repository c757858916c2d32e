"""The batcher and its batch buckets against the real server (issue 33, item 2), on the
CPU: a toy handler (tests/fixtures/handlers/bucketed.py) says in ``initialize`` that it runs
its batches padded to buckets 1, 2, 4 and 8 (``context.execution``, reported in LOADED), as a
CUDA-graph model does; another says it fell back to eager.

- describe (REST and gRPC) shows each worker's Execution and each model's buckets in effect;
- the adaptive policy sends 4 of 5 queued requests and keeps 1 for the next batch (both fill
  their buckets), where TorchServe's fixed rule sends 5, padded to 8;
- under concurrent load the batches' hits and padded rows are counted exactly as the sizes the
  handler saw say, on the metrics page, in describe and in the live page's data.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests

from frontend.serving.buckets import padded_rows
from model_archiver.packaging import ArchiveOptions, build_archive
from protos import management_pb2, management_pb2_grpc
from tests.conftest import HANDLERS, RunningServer, launch_server

BUCKETS = (1, 2, 4, 8)
PADDED = {"mode": "padded", "batchBuckets": [1, 2, 4, 8], "fallbackReason": "",
          "graphPoolBytes": 0}
FELL_BACK = "toy: torch.cuda.graphs refused a host sync in forward"
#: Each model's model-config.yaml: its policy, and what its handler reports.
MODELS = {
    "split": "batchPolicy: adaptive\nmaxBatchDelay: 100\n",
    "fixedpad": "batchPolicy: fixed\nmaxBatchDelay: 50\n",
    "loaded": "batchPolicy: adaptive\nmaxBatchDelay: 20\n",
    "eager": ("handler:\n  toy_execution:\n    mode: eager\n    batch_buckets: []\n"
              f"    fallback_reason: '{FELL_BACK}'\n"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("buckets")
    store = root / "model_store"
    store.mkdir()
    for name, config in MODELS.items():
        config_file = root / f"{name}.yaml"
        config_file.write_text(f"batchSize: 8\n{config}")
        build_archive(ArchiveOptions(model_name=name, version="1.0",
                                     handler=str(HANDLERS / "bucketed.py"), export_path=store,
                                     force=True, config_file=str(config_file)))
    running = launch_server(store, *(f"{name}={name}.mar" for name in MODELS))
    try:
        yield running
    finally:
        running.stop()


def _counters(server: RunningServer, model: str) -> dict[str, float]:
    """The model's bucket counters on the metrics page (absent: 0)."""
    page = requests.get(f"{server.metrics}/metrics", timeout=30).text
    labels = f'{{model_name="{model}",model_version="1.0",}}'
    found: dict[str, float] = {}
    for line in page.splitlines():
        name, _, value = line.partition(f"{labels} ")
        if value and name.startswith(("batchserve_batch_bucket", "batchserve_batch_padding")):
            found[name] = float(value)
    return found


def _answers(futures: list[Any]) -> list[dict[str, int]]:
    answers = []
    for future in futures:
        response = future.result(timeout=60)
        assert response.status_code == 200, response.text
        answers.append(response.json())
    return answers


def test_describe_shows_each_workers_execution_and_the_models_buckets(
        server: RunningServer) -> None:
    described = server.describe("split")
    (worker,) = described["workers"]  # type: ignore[misc]
    assert worker["execution"] == PADDED
    assert described["batching"]["buckets"]["sizes"] == list(BUCKETS)  # type: ignore[index]
    eager = server.describe("eager")
    assert eager["workers"][0]["execution"] == {  # type: ignore[index]
        "mode": "eager", "batchBuckets": [], "fallbackReason": FELL_BACK, "graphPoolBytes": 0}
    assert eager["batching"]["buckets"] == {  # type: ignore[index]
        "sizes": [], "batches": 0, "hits": 0, "rows": 0, "paddedRows": 0, "paddingShare": 0.0}
    # gRPC's DescribeModel answers the same body (frontend/ops/management.py).
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_management_port}") as channel:
        stub = management_pb2_grpc.ManagementAPIsServiceStub(channel)
        reply = stub.DescribeModel(management_pb2.DescribeModelRequest(model_name="split"),
                                   timeout=30)
    (over_grpc,) = json.loads(reply.msg)
    assert over_grpc["workers"][0]["execution"] == PADDED
    assert over_grpc["batching"]["buckets"]["sizes"] == list(BUCKETS)


@pytest.mark.parametrize(("model", "sizes", "counted"), [
    # Adaptive: 4 of the 5 now, the 1 left next; every batch fills its bucket.
    ("split", [4, 4, 4, 4, 1], {"batches": 3, "hits": 3, "rows": 6, "paddedRows": 0}),
    # TorchServe's fixed rule: the 5 together, padded to 8.
    ("fixedpad", [5, 5, 5, 5, 5], {"batches": 2, "hits": 1, "rows": 9, "paddedRows": 3}),
])
def test_five_queued_leave_as_a_bucket_and_the_rest_or_padded_by_the_fixed_rule(
        server: RunningServer, tmp_path: Path, model: str, sizes: list[int],
        counted: dict[str, int]) -> None:
    gate = tmp_path / "gate"
    with ThreadPoolExecutor(max_workers=6) as pool:
        # One request holds the worker; five wait in the queue behind it.
        held = server.hold_gate(pool, gate, queued=5, model=model)
        gate.touch()
        answers = _answers(held)
    assert answers[0] == {"batch": 1, "rows": 1}
    assert sorted(answer["batch"] for answer in answers[1:]) == sorted(sizes)
    assert all(answer["rows"] == padded_rows(answer["batch"], BUCKETS) for answer in answers)
    server.wait_for(lambda: server.describe(model)["batching"]["batchesTotal"]  # type: ignore[index]
                    == counted["batches"], "the batches' ends to be counted")
    buckets = server.describe(model)["batching"]["buckets"]  # type: ignore[index]
    assert {name: buckets[name] for name in counted} == counted
    metrics = _counters(server, model)
    assert metrics == {"batchserve_batch_bucket_batches_total": counted["batches"],
                       "batchserve_batch_bucket_hits_total": counted["hits"],
                       "batchserve_batch_bucket_rows_total": counted["rows"],
                       "batchserve_batch_padding_rows_total": counted["paddedRows"]}


def test_under_concurrent_load_hits_and_padding_are_counted_as_the_batches_ran(
        server: RunningServer) -> None:
    sizes: Counter[int] = Counter()
    lock = threading.Lock()

    def client() -> None:
        with requests.Session() as session:
            for _ in range(8):
                response = session.post(f"{server.inference}/predictions/loaded",
                                        data=b"0.01", timeout=60)
                assert response.status_code == 200, response.text
                with lock:
                    sizes[response.json()["batch"]] += 1

    threads = [threading.Thread(target=client) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sum(sizes.values()) == 48
    # Each batch of n answered n requests, each saying n.
    batches = {size: count // size for size, count in sizes.items()}
    assert all(count % size == 0 for size, count in sizes.items()), sizes
    assert max(batches) > 1  # six clients on one worker: batches form
    expected = {
        "batches": sum(batches.values()),
        "hits": sum(count for size, count in batches.items()
                    if padded_rows(size, BUCKETS) == size),
        "rows": sum(count * padded_rows(size, BUCKETS) for size, count in batches.items()),
    }
    expected["paddedRows"] = expected["rows"] - 48
    assert expected["hits"] >= 1
    server.wait_for(lambda: server.describe("loaded")["batching"]["batchesTotal"]  # type: ignore[index]
                    == expected["batches"], "the batches' ends to be counted")
    buckets = server.describe("loaded")["batching"]["buckets"]  # type: ignore[index]
    assert {name: buckets[name] for name in expected} == expected
    assert buckets["paddingShare"] == round(expected["paddedRows"] / expected["rows"], 3)
    assert _counters(server, "loaded")["batchserve_batch_padding_rows_total"] == \
        expected["paddedRows"]


def test_the_live_page_data_carries_the_buckets_hits_and_executions(
        server: RunningServer) -> None:
    url = f"{server.management}/dashboard/data"
    deadline = time.monotonic() + 30
    while True:
        # A batch now and then, until a sample (one a second) covers one.
        requests.post(f"{server.inference}/predictions/loaded", data=b"0", timeout=60)
        document = requests.get(url, timeout=30).json()
        model = next(m for m in document["models"] if m["model"] == "loaded")
        rows = [row for sample in document["samples"] for row in sample["models"]
                if row["model"] == "loaded" and "buckets" in row]
        if rows:
            break
        assert time.monotonic() < deadline, f"no sample with the buckets: {document['models']}"
        time.sleep(0.2)
    assert model["buckets"]["sizes"] == list(BUCKETS) and model["buckets"]["batches"] >= 1
    assert model["buckets"]["hits"] <= model["buckets"]["batches"]
    assert model["workers"][0]["execution"] == PADDED
    shares = rows[-1]["buckets"]
    assert shares["batches"] > 0 and 0 <= shares["hitShare"] <= 1
    assert 0 <= shares["paddingShare"] < 1
    eager = next(m for m in document["models"] if m["model"] == "eager")
    assert eager["buckets"]["sizes"] == []
    assert eager["workers"][0]["execution"]["fallbackReason"] == FELL_BACK
