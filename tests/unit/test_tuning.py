"""model-config.yaml's speed switches: pt2 as TorchServe 0.12 reads it, amp, channels_last,
warm-up; and a compiled model that fails falls back to the model it came from."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from backend.errors import ModelLoadError
from backend.handlers.buckets import MAX_DEFAULT_BUCKET, default_buckets, plan_chunks
from backend.handlers.tuning import (
    Tuning,
    pt2_compile_options,
    read_tuning,
    warmup_sizes,
)
from backend.service.model_service import ModelService
from tests.unit.test_handlers import (
    TINY_CLASSIFIER,
    batch,
    eager_model_dir,
    handler_of,
    image,
    load,
    predictions,
    request,
    restore_import_state,  # noqa: F401 (an autouse fixture of these tests too)
)

FAILING_BACKEND = TINY_CLASSIFIER + """

    import torch._dynamo


    def always_fails(graph, example_inputs):
        raise RuntimeError("this backend cannot compile anything")


    if "always_fails" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(always_fails)
"""


@pytest.mark.parametrize(("pt2", "expected"), [
    ({"compile": {"enable": True, "backend": "eager", "mode": "default"}},
     {"backend": "eager", "mode": "default"}),
    ({"compile": {"enable": True}}, {}),
    ({"compile": {"enable": False, "backend": "eager"}}, None),
    ({"export": {"aot_compile": True}}, None),
    ("eager", {"backend": "eager"}),
    ({"backend": "eager", "fullgraph": True}, {"backend": "eager", "fullgraph": True}),
    ({"compile": {"enable": True, "backend": "no-such-backend"}}, None),
])
def test_pt2_is_read_as_torchserve_reads_it(pt2: Any, expected: dict[str, Any] | None) -> None:
    assert pt2_compile_options(pt2) == expected


@pytest.mark.parametrize(("config", "message"), [
    ({"pt2": 3}, "pt2 must be"),
    ({"handler": {"amp": "fp8"}}, "amp must be"),
    ({"handler": {"image_decode": "gpu"}}, "image_decode must be"),
    ({"handler": {"warmup": [0, 2]}}, "warmup must be"),
    ({"handler": {"warmup": "yes"}}, "warmup must be"),
    ({"handler": "fast"}, "handler must be a mapping"),
])
def test_bad_switches_fail_the_load_with_a_clear_message(config: dict[str, Any],
                                                         message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        read_tuning(config)


def test_warmup_sizes() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    # On CUDA the warm-up runs the buckets batches run in (docs/cuda_graphs.md).
    assert warmup_sizes(Tuning(), cuda, 4, default_buckets(4)) == [1, 2, 4]
    assert warmup_sizes(Tuning(), cuda, 30, default_buckets(30)) == [1, 2, 4, 8, 16, 30]
    assert len(warmup_sizes(Tuning(), cuda, 128, default_buckets(128))) == 8
    # Issue 31: batch_size may be as large as int32; the buckets, and the warm-up, are bounded.
    huge = warmup_sizes(Tuning(), cuda, 2**31 - 1, default_buckets(2**31 - 1))
    assert huge[:5] == [1, 2, 4, 8, 16] and huge[-1] == MAX_DEFAULT_BUCKET
    assert len(huge) == MAX_DEFAULT_BUCKET.bit_length()
    # Without buckets (batch_buckets: []), CUDA warms the smallest and largest batch.
    assert warmup_sizes(Tuning(), cuda, 30) == [1, 30]
    assert warmup_sizes(Tuning(), cpu, 4) == []
    assert warmup_sizes(Tuning(), cpu, 4, (1, 2, 4)) == []  # padded, eager: nothing to tune
    assert warmup_sizes(Tuning(compile_options={}), cpu, 8) == [1, 8]
    assert warmup_sizes(Tuning(compile_options={}), cpu, 8, (2, 8)) == [2, 8]
    assert warmup_sizes(Tuning(warmup=(2, 6)), cpu, 8) == [2, 6]
    # A warm-up list runs the buckets its sizes run in (chunks too: 19 is 8 + 8 + 3).
    assert warmup_sizes(Tuning(warmup=(3, 19)), cuda, 8, (1, 2, 4, 8)) == [4, 8]
    assert warmup_sizes(Tuning(warmup=(2**31 - 1,)), cuda, 8, (1, 2, 4, 8)) == [8]
    assert warmup_sizes(Tuning(warmup_off=True), cuda, 8, (1, 8)) == []


def test_on_cuda_a_batch_runs_at_a_size_the_warm_up_saw() -> None:
    cuda = torch.device("cuda", 0)
    for batch_size in (1, 7, 8, 30, 128):
        buckets = default_buckets(batch_size)
        seen = set(warmup_sizes(Tuning(), cuda, batch_size, buckets))
        for size in range(1, batch_size + 1):
            [(start, stop, bucket)] = plan_chunks(size, buckets)
            assert (start, stop) == (0, size) and bucket in seen
            assert size <= bucket < 2 * size  # at most size - 1 padded rows


def _service(tmp_path: Path, config: str, source: str = TINY_CLASSIFIER) -> ModelService:
    tmp_path.mkdir()
    model_dir = eager_model_dir(tmp_path, source)
    (model_dir / "model-config.yaml").write_text(textwrap.dedent(config))
    return load(model_dir, batch_size=4, manifest_json=json.dumps({"model": {
        "modelName": "tiny", "handler": "image_classifier", "modelFile": "model.py",
        "serializedFile": "model.pt", "configFile": "model-config.yaml"}}))


def _answers(service: ModelService) -> list[Any]:
    return predictions(service.predict(batch(*(request(image(seed)) for seed in range(3)))))


@pytest.mark.parametrize(("backend", "source", "compiled"), [
    ("eager", TINY_CLASSIFIER, True),
    # Compiling fails at the first call, in the warm-up: the model it came from serves.
    ("always_fails", FAILING_BACKEND, False),
])
def test_a_compiled_model_answers_as_the_eager_one(tmp_path: Path, backend: str, source: str,
                                                   compiled: bool) -> None:
    eager = _answers(_service(tmp_path / "eager", "handler: {}\n"))
    service = _service(tmp_path / "compiled", f"""
        pt2:
          compile:
            enable: true
            backend: {backend}
        """, source=source)
    model = handler_of(service).model
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule) is compiled
    for a, b in zip(_answers(service), eager, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_bf16_autocast_and_channels_last(tmp_path: Path) -> None:
    fp32 = _answers(_service(tmp_path / "fp32", "handler: {}\n"))
    service = _service(tmp_path / "bf16", """
        handler:
          amp: bf16
          channels_last: true
          warmup: [1, 3]
        """)
    handler = handler_of(service)
    assert handler.tuning.amp is torch.bfloat16 and handler.pipeline._channels_last
    answers = _answers(service)
    for a, b in zip(answers, fp32, strict=True):
        assert list(a) == list(b)  # the same classes, in the same order
        assert a == pytest.approx(b, abs=0.05)  # bf16 keeps about 3 significant digits


def test_the_padded_rows_never_reach_the_results(tmp_path: Path) -> None:
    from tests.unit.test_handlers import count_forward_calls

    service = _service(tmp_path / "padded", """
        handler:
          batch_buckets: [4, 16]
        """)
    handler = handler_of(service)
    inputs = torch.randn(11, 3, 224, 224)
    with torch.inference_mode():
        assert handler.model is not None
        expected = handler.model(inputs)
        sizes = count_forward_calls(service)
        padded = handler.inference(inputs)
    assert sizes == [16]  # the model ran at a bucket's size
    assert padded.shape == expected.shape == (11, 3)
    assert torch.allclose(padded, expected, atol=1e-5)
