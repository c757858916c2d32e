"""The workflow benchmark's handlers (benchmarks/handlers/wf_*.py) and its report, in process:
the function nodes answer one item per input with TorchServe's input naming, the classifier
loads its serialized weights and batches, and the report's ratios are computed per load."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from benchmarks import loadgen
from benchmarks.workflow import Point, bodies, report

HANDLERS = Path(__file__).resolve().parents[2] / "benchmarks" / "handlers"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", HANDLERS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


functions = _load("wf_functions")


def test_pre_standardises_each_request_of_a_batch() -> None:
    requests = [json.loads(body) for body in bodies(3, seed=1)]
    rows: list[dict[str, Any]] = [{"body": json.dumps(requests[0]).encode()},  # bytes
                                  {"data": requests[1]},  # decoded JSON (application/json)
                                  {"body": json.dumps(requests[2])}]  # text
    assert functions.pre(None, None) is None
    out = functions.pre(rows, None)
    assert len(out) == 3
    for features in out:
        assert len(features) == 64
        assert abs(sum(features) / 64) < 1e-4
        assert abs(math.sqrt(sum(x * x for x in features) / 64) - 1) < 1e-3
    with pytest.raises(ValueError, match="64 numbers"):
        functions.pre([{"body": b'{"features": [1, 2]}'}], None)


def test_post_and_ensemble_take_parents_by_name() -> None:
    a = [0.0] * 10
    a[3] = 1.0
    b = [0.1] * 10
    assert functions.post([{"body": json.dumps(a).encode()}], None) == [
        {"label": "cat", "score": 1.0}]
    out = functions.ensemble([{"classifier_a": json.dumps(a).encode(),
                               "classifier_b": json.dumps(b).encode()}], None)
    assert out == [{"label": "cat", "score": 0.55,
                    "votes": {"classifier_a": "cat", "classifier_b": "airplane"}}]


def test_classifier_loads_its_weights_and_answers_a_batch(tmp_path: Path) -> None:
    classifier = _load("wf_classifier")
    torch.manual_seed(3)
    reference = classifier.build().eval()
    torch.save(reference.state_dict(), tmp_path / "weights.pt")
    context = SimpleNamespace(system_properties={"model_dir": str(tmp_path)},
                              manifest={"model": {"serializedFile": "weights.pt"}})
    assert classifier.handle(None, context) is None
    features = functions.pre([{"body": body} for body in bodies(5, seed=2)], None)
    rows = [{"body": json.dumps(row).encode()} for row in features]
    out = classifier.handle(rows, context)
    with torch.inference_mode():
        expected = torch.softmax(reference(torch.tensor(features)), dim=1).tolist()
    assert len(out) == 5
    for got, want in zip(out, expected, strict=True):
        assert got == pytest.approx(want, abs=1e-5)


def test_report_gives_ratios_per_load() -> None:
    ours = loadgen.LoadResult("closed", 10.0, clients=8, sent=100, completed_in_window=400,
                              latencies_s=[0.01] * 98 + [0.05] * 2)
    ours.statuses["200"] = 100
    theirs = loadgen.LoadResult("closed", 10.0, clients=8, sent=103, completed_in_window=100,
                                latencies_s=[0.02] * 98 + [0.2] * 2)
    theirs.statuses.update({"200": 100, "500": 3})
    point = Point("wf_seq", "8 clients", clients=8,
                  results={"batchserve": ours, "torchserve": theirs},
                  batches={"batchserve": {"pre": 2.0, "classifier": 2.5, "post": 1.5}})
    text = report([point], ["batchserve", "torchserve"], "### header")
    assert "| wf_seq | 8 clients | batchserve | 10 | 40.0 | 10.0 | 50.0 | 0 | pre 2.0 " \
           "classifier 2.5 post 1.5 |" in text
    assert "| wf_seq | 8 clients | torchserve | 10 | 10.0 | 20.0 | 200 | 500: 3 | n/a |" in text
    assert "- wf_seq, 8 clients: throughput x4.00, p99 x0.25 (vs torchserve; failed or " \
           "skipped: batchserve 0, torchserve 3)" in text
