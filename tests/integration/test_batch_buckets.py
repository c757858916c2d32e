"""Batch buckets through the real server on the CPU (issue 33): an image_classifier whose
model-config.yaml sets ``batch_buckets: [1, 2, 4]`` pads its batches to them and answers as
the same model without buckets, and its worker reports how it runs (mode "padded", the
buckets) when it has loaded."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from model_archiver.packaging import ArchiveOptions, build_archive
from tests.integration.vision_fixtures import LABELS, jpeg, tiny_model_files

BUCKETS = "[1, 2, 4]"
LABEL_NAMES = {label for _, label in LABELS.values()}


def _archive(store: Path, name: str, config: str | None) -> None:
    model_file, weights, labels = tiny_model_files(store.parent / f"{name}-src")
    config_file = None
    if config is not None:
        config_file = store.parent / f"{name}-config.yaml"
        config_file.write_text(config)
    build_archive(ArchiveOptions(
        model_name=name, version="1.0", model_file=str(model_file),
        serialized_file=str(weights), handler="image_classifier", extra_files=(str(labels),),
        config_file=str(config_file) if config_file else None, export_path=store, force=True))


def test_padded_buckets_answer_as_the_unpadded_model(model_store: Path, start_server) -> None:
    _archive(model_store, "bucketed", f"handler:\n  batch_buckets: {BUCKETS}\n")
    _archive(model_store, "plain", None)  # the same weights (seeded), no buckets
    server = start_server(number_of_gpu=0)  # the CPU's padded path, on a GPU host too
    # The fixed policy waits for 4 requests up to max_batch_delay: the bucketed model's
    # batch of 3 must form (the plain model's batches may be any).
    for name, delay_ms in (("bucketed", 2000), ("plain", 500)):
        requests.post(f"{server.management}/models",
                      params={"url": f"{name}.mar", "batch_size": 4, "max_batch_delay": delay_ms,
                              "batch_policy": "fixed", "initial_workers": 1,
                              "synchronous": "true"}, timeout=120).raise_for_status()
    bodies = [jpeg(seed) for seed in range(7)]

    def answers(name: str, group: list[bytes]) -> list[dict[str, float]]:
        with ThreadPoolExecutor(len(group)) as pool:
            replies = list(pool.map(lambda body: server.predict(name, body), group))
        assert all(reply.status_code == 200 for reply in replies), [r.text for r in replies]
        return [reply.json() for reply in replies]

    # 3 at once: one batch of 3, run padded to 4; then 4 more: a full bucket.
    bucketed = answers("bucketed", bodies[:3]) + answers("bucketed", bodies[3:])
    plain = answers("plain", bodies[:3]) + answers("plain", bodies[3:])
    alone = [server.predict("plain", body).json() for body in bodies[:2]]
    assert server.describe("bucketed")["batching"]["recentBatchSizes"] == [3, 4]  # type: ignore[index]
    for got, want in zip(bucketed, plain, strict=True):
        assert set(got) == LABEL_NAMES and list(got) == list(want)
        assert got == pytest.approx(want, abs=1e-6)
    for got, want in zip(bucketed[:2], alone, strict=True):
        assert got == pytest.approx(want, abs=1e-6)

    model_log = model_store.parent / "logs" / "model_log.log"

    def loaded_line(name: str) -> str:
        lines = [line for line in model_log.read_text().splitlines()
                 if f"model {name} loaded in" in line]
        return lines[-1] if lines else ""

    server.wait_for(lambda: bool(loaded_line("bucketed") and loaded_line("plain")),
                    "both workers' load lines in the model log")
    assert loaded_line("bucketed").endswith(
        f"; its batches run padded, eagerly in buckets {BUCKETS}")
    assert loaded_line("plain").endswith("; its batches run eagerly, at their own size")
