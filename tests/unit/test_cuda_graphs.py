"""CUDA graphs captured for real (issue 33; the CPU half is tests/unit/test_graphs.py): a small
CNN per bucket, replaying without a Python forward, equal to the eager model; a model that
reads a value back (``.item()``) falls back to eager with the reason; the pool's memory is
counted; torch.compile (default mode) and TorchScript models are captured or fall back with a
reason; autocast; the image classifier through load_service. Skipped without CUDA."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from backend.handlers.buckets import default_buckets
from backend.handlers.graphs import (
    MODE_CUDA_GRAPHS,
    MODE_PADDED,
    BatchRunner,
    CUDAGraphCapture,
)
from tests.unit import test_handlers as handlers
from tests.unit.test_handlers import restore_import_state  # noqa: F401 (autouse here too)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUCKETS = (1, 2, 4, 8)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class ReadsBack(nn.Module):
    """Scales its batch by the batch's largest value, read back with ``.item()``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = SmallCNN()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        largest = x.abs().max().item()  # repeated rows do not change it
        return self.net(x / max(largest, 1.0))


class Counted(nn.Module):
    """Counts the Python calls of its forward (a replay makes none)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.calls = 0

    def forward(self, x: torch.Tensor) -> Any:
        self.calls += 1
        return self.model(x)


def _cuda(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return model.cuda().eval()


def _runner(model: Any, buckets: tuple[int, ...] = BUCKETS) -> BatchRunner:
    return BatchRunner(model, buckets, CUDAGraphCapture(torch.device("cuda", 0)), who="test")


def _close(got: torch.Tensor, want: torch.Tensor, tolerance: float = 1e-3) -> bool:
    """Equal within ``tolerance`` of the largest value (cuDNN may pick other algorithms for
    a padded batch's size: TF32 rounding)."""
    scale = max(1.0, float(want.abs().max()))
    return float((got.float() - want.float()).abs().max()) <= tolerance * scale


def test_a_small_cnn_replays_its_graphs_and_gives_the_eager_outputs() -> None:
    model = Counted(_cuda(SmallCNN()))
    runner = _runner(model)
    with torch.inference_mode():
        for size in (1, 3, 8, 11):  # 11: a chunk of 8 and one of 3 (padded to 4)
            inputs = torch.randn(size, 3, 32, 32, device="cuda")
            assert _close(runner(inputs), model.model(inputs)), size
        execution = runner.execution()
        assert execution.mode == MODE_CUDA_GRAPHS, execution.fallback_reason
        assert list(execution.batch_buckets) == list(BUCKETS)
        assert execution.graph_pool_bytes > 0
        calls = model.calls
        for size in (2, 5, 8):  # every bucket captured (2 now): replays, no forward in Python
            inputs = torch.randn(size, 3, 32, 32, device="cuda")
            assert _close(runner(inputs), model.model(inputs))
        # Bucket 2's preparation only (3 warm-up runs, the capture, the eager check); the
        # references above call the inner model, and a replay calls nothing in Python.
        assert model.calls == calls + 5
    assert runner.execution().graph_pool_bytes >= execution.graph_pool_bytes


def test_outputs_are_copied_out_of_the_static_buffers() -> None:
    model = _cuda(SmallCNN())
    runner = _runner(model, (4,))
    with torch.inference_mode():
        first_inputs = torch.randn(4, 3, 32, 32, device="cuda")
        first = runner(first_inputs)
        runner(torch.randn(4, 3, 32, 32, device="cuda"))
        assert _close(first, model(first_inputs))


def test_a_model_that_reads_a_value_back_falls_back_to_eager_with_the_reason() -> None:
    model = _cuda(ReadsBack())
    runner = _runner(model)
    with torch.inference_mode():
        for size in (3, 1, 8):
            inputs = torch.randn(size, 3, 32, 32, device="cuda")
            assert _close(runner(inputs), model(inputs))
    execution = runner.execution()
    assert execution.mode == MODE_PADDED and list(execution.batch_buckets) == list(BUCKETS)
    assert execution.fallback_reason.startswith("bucket 4 could not be prepared: ")
    assert execution.graph_pool_bytes == 0


@pytest.mark.parametrize("kind", ["compiled", "torchscript"])
def test_compiled_and_scripted_models_are_captured_or_say_why_not(kind: str) -> None:
    eager = _cuda(SmallCNN())
    if kind == "compiled":
        model: Any = torch.compile(eager)  # the default mode
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch deprecates TorchScript
            model = torch.jit.script(eager)
    runner = _runner(model, (2, 4))
    with torch.inference_mode():
        for size in (2, 3, 4):
            inputs = torch.randn(size, 3, 32, 32, device="cuda")
            assert _close(runner(inputs), eager(inputs), 1e-2), size
    execution = runner.execution()
    assert (execution.mode == MODE_CUDA_GRAPHS and execution.graph_pool_bytes > 0) or (
        execution.mode == MODE_PADDED and execution.fallback_reason), execution


def test_a_graph_captured_under_autocast_gives_the_autocast_outputs() -> None:
    model = _cuda(SmallCNN())
    runner = _runner(model, (4,))
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(3):  # each replay reads its own input (no cast weights freed)
            inputs = torch.randn(3, 3, 32, 32, device="cuda")
            got = runner(inputs)
            assert got.dtype == torch.bfloat16
            assert _close(got, model(inputs), 5e-2)
    assert runner.execution().mode == MODE_CUDA_GRAPHS, runner.execution().fallback_reason


def test_the_image_classifier_captures_its_buckets_at_load(tmp_path: Path) -> None:
    graphs_dir = tmp_path / "graphs"
    eager_dir = tmp_path / "eager"
    graphs_dir.mkdir()
    eager_dir.mkdir()
    graphs = handlers.load(handlers.eager_model_dir(graphs_dir), batch_size=4, gpu_id=0)
    model_dir = handlers.eager_model_dir(eager_dir)
    (model_dir / "model-config.yaml").write_text("handler:\n  cuda_graphs: false\n")
    value = json.loads(handlers.manifest("image_classifier"))
    value["model"]["configFile"] = "model-config.yaml"
    eager = handlers.load(model_dir, batch_size=4, gpu_id=0, manifest_json=json.dumps(value))
    execution = graphs.context.execution
    assert execution.mode == MODE_CUDA_GRAPHS, execution.fallback_reason
    assert tuple(execution.batch_buckets) == default_buckets(4)
    assert execution.graph_pool_bytes > 0
    assert eager.context.execution.mode == MODE_PADDED
    assert not eager.context.execution.fallback_reason
    assert handlers.handler_of(graphs).device.type == "cuda"
    bodies = [handlers.request(handlers.image(seed)) for seed in range(3)]
    for got, want in zip(handlers.predictions(graphs.predict(handlers.batch(*bodies))),
                         handlers.predictions(eager.predict(handlers.batch(*bodies))), strict=True):
        assert list(got) == list(want)
        assert got == pytest.approx(want, abs=1e-4)
