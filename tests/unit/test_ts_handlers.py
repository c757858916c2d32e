"""A handler subclassing each of ``ts.torch_handler``'s classes loads in batchserve's worker
and answers a request; those whose optional package (DALI, PiPPy, TensorRT-LLM, vLLM) is
missing fail to load with an error naming it.

Loaded in-process the way the worker loads them (``load_service`` + ``ModelService.predict``,
the shim installed as the worker installs it), each from a model directory written by the
test: its handler, a tiny model (seeded weights) and what the class reads (labels, a
vocabulary).
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from backend.errors import HandlerLoadError
from tests.integration.vision_fixtures import LABELS, jpeg, tiny_model_files
from tests.unit.test_ts_compat import batch, handler_of, load, ts_shim

__all__ = ["ts_shim"]  # the autouse fixture that installs the shim for each test


def write(folder: Path, name: str, source: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(source).lstrip(), encoding="utf-8")
    return path


def save_model(folder: Path, source: str, class_name: str) -> dict[str, str]:
    """model.py with ``source`` and seeded weights of its one class; the manifest entries."""
    write(folder, "model.py", source)
    namespace: dict[str, Any] = {}
    exec(compile(textwrap.dedent(source), "model.py", "exec"), namespace)
    torch.manual_seed(0)
    torch.save(namespace[class_name]().state_dict(), folder / "model.pt")
    return {"modelFile": "model.py", "serializedFile": "model.pt"}


def vision_model(folder: Path) -> dict[str, str]:
    model_file, weights, _ = tiny_model_files(folder)
    return {"modelFile": model_file.name, "serializedFile": weights.name}


SEGMENTER = """
    import torch
    from torch import nn


    class TinySegmenter(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, kernel_size=16, stride=16)

        def forward(self, x):
            return {"out": self.conv(x)}
"""

DETECTOR = """
    import torch
    from torch import nn


    class TinyDetector(nn.Module):
        \"\"\"Two detections per image, of classes 1 and 2, scored by the image's mean.\"\"\"

        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, images):
            results = []
            for image in images:
                high = torch.sigmoid(image.mean() * 0 + 3.0) * self.scale
                results.append({"boxes": torch.tensor([[0.0, 0.0, 4.0, 4.0], [1.0, 1.0, 2.0, 2.0]]),
                                "labels": torch.tensor([1, 2]),
                                "scores": torch.stack([high[0], high[0] * 0.1])})
            return results
"""

TEXT_MODEL = """
    from torch import nn


    class TinyText(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.EmbeddingBag(8, 4, mode="mean")
            self.fc = nn.Linear(4, 2)

        def forward(self, text, offsets):
            return self.fc(self.embedding(text, offsets))
"""

LINEAR = """
    from torch import nn


    class TinyLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x)
"""


def text_model(folder: Path) -> dict[str, str]:
    entries = save_model(folder, TEXT_MODEL, "TinyText")
    vocab = {"<unk>": 0, "hello": 1, "world": 2, "i": 3, "am": 4, "fine": 5, "hello world": 6}
    torch.save(vocab, folder / "source_vocab.pt")
    (folder / "index_to_name.json").write_text(json.dumps({"0": "neg", "1": "pos"}))
    return entries


def check_probabilities(labels: set[str]) -> Any:
    def check(body: bytes) -> None:
        answer = json.loads(body)
        assert set(answer) == labels
        assert sum(answer.values()) == pytest.approx(1.0)
    return check


# class -> (handler source, model maker, request body, content type, check of the answer)
CASES: dict[str, tuple[str, Any, bytes, str | None, Any]] = {
    "BaseHandler": ("""
        import torch
        from ts.torch_handler.base_handler import BaseHandler


        class Handler(BaseHandler):
            def preprocess(self, data):
                return torch.tensor([row["body"] for row in data], dtype=torch.float32)
        """, lambda folder: save_model(folder, LINEAR, "TinyLinear"),
        json.dumps([1.0, 2.0, 3.0, 4.0]).encode(), "application/json",
        lambda body: len(json.loads(body)) == 2),
    "VisionHandler": ("""
        from torchvision import transforms
        from ts.torch_handler.vision_handler import VisionHandler


        class Handler(VisionHandler):
            image_processing = transforms.Compose([transforms.Resize((40, 40)),
                                                   transforms.ToTensor()])
        """, vision_model, jpeg(1), None, lambda body: len(json.loads(body)) == 3),
    "ImageClassifier": ("""
        from ts.torch_handler.image_classifier import ImageClassifier


        class Handler(ImageClassifier):
            topk = 2
        """, vision_model, jpeg(2), None,
        lambda body: set(json.loads(body)) <= {label for _, label in LABELS.values()}
        and len(json.loads(body)) == 2),
    "ImageSegmenter": ("""
        from ts.torch_handler.image_segmenter import ImageSegmenter


        class Handler(ImageSegmenter):
            pass
        """, lambda folder: save_model(folder, SEGMENTER, "TinySegmenter"), jpeg(3), None,
        # 224 / 16 = 14 rows of 14 pixels, each [class, probability]
        lambda body: (len(json.loads(body)), len(json.loads(body)[0]),
                      len(json.loads(body)[0][0])) == (14, 14, 2)),
    "ObjectDetector": ("""
        from ts.torch_handler.object_detector import ObjectDetector


        class Handler(ObjectDetector):
            threshold = 0.5
        """, lambda folder: {**save_model(folder, DETECTOR, "TinyDetector"),
                             **_labels(folder)}, jpeg(4), None,
        lambda body: [set(d) for d in json.loads(body)] == [{"square", "score"}]),
    "TextHandler": ("""
        import torch
        from ts.torch_handler.text_handler import TextHandler


        class Handler(TextHandler):
            def preprocess(self, data):
                text = data[0]["body"]
                words = self._tokenize(self._remove_punctuation(self._expand_contractions(
                    self._remove_html_tags(text.lower()))))
                return words

            def inference(self, data):
                return [[self.source_vocab[word] for word in data]]

            def postprocess(self, data):
                return data
        """, text_model, b"<b>Hello</b> world, I'm fine!", "text/plain",
        lambda body: json.loads(body) == [1, 2, 3, 4, 5]),
    "TextClassifier": ("""
        from ts.torch_handler.text_classifier import TextClassifier


        class Handler(TextClassifier):
            pass
        """, text_model, b"Hello world, I'm fine", "text/plain",
        check_probabilities({"neg", "pos"})),
    "DenseNetHandler": ("""
        from ts.torch_handler.densenet_handler import DenseNetHandler


        class Handler(DenseNetHandler):
            pass
        """, lambda folder: save_model(folder, LINEAR, "TinyLinear"), b"", None,
        lambda body: torch.load(io.BytesIO(body), weights_only=True).shape == (1, 2)),
    "BaseDeepSpeedHandler": ("""
        from ts.torch_handler.distributed.base_deepspeed_handler import BaseDeepSpeedHandler


        class Handler(BaseDeepSpeedHandler):
            def handle(self, data, context):
                return [{"rank": self.device} for _ in data]
        """, lambda folder: {}, b"x", None, lambda body: json.loads(body) == {"rank": 0}),
}

#: class -> (the module to import it from, the optional package it needs)
OPTIONAL = {
    "DALIHandler": ("dali_handler", "nvidia.dali"),
    "DALIImageClassifier": ("dali_image_classifier", "nvidia.dali"),
    "BasePippyHandler": ("distributed.base_pippy_handler", "pippy"),
    "TRTLLMHandler": ("trt_llm_handler", "tensorrt_llm"),
    "VLLMHandler": ("vllm_handler", "vllm"),
}


def _labels(folder: Path) -> dict[str, str]:
    (folder / "index_to_name.json").write_text(json.dumps({"1": "square", "2": "circle"}))
    return {}


def installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:
        return False


def test_every_torch_handler_class_is_covered_here() -> None:
    """The cases name every public class of the shim's ts.torch_handler."""
    import pkgutil

    torch_handler = importlib.import_module("ts.torch_handler")
    classes = set()
    for info in pkgutil.walk_packages(torch_handler.__path__, "ts.torch_handler."):
        if ".request_envelope" in info.name or info.name.rsplit(".", 1)[-1] in {
                module.rsplit(".", 1)[-1] for module, _ in OPTIONAL.values()}:
            continue
        module = importlib.import_module(info.name)
        classes |= {name for name, value in vars(module).items()
                    if isinstance(value, type) and value.__module__ == info.name
                    and not name.startswith("_") and hasattr(value, "handle")}
    assert classes == set(CASES), classes ^ set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_a_subclass_of_each_torch_handler_class_loads_and_answers(tmp_path: Path,
                                                                   name: str) -> None:
    source, make_model, body, content_type, check = CASES[name]
    folder = tmp_path / "model"
    folder.mkdir()
    write(folder, "handler.py", source)
    entries = make_model(folder)
    if name == "DenseNetHandler":
        buffer = io.BytesIO()
        torch.save(torch.ones(4), buffer)
        body = buffer.getvalue()

    service = load(folder, "handler.py", entries)
    result = service.predict(batch(body, content_type=content_type))

    handler = handler_of(service)
    base = getattr(importlib.import_module(_module_of(name)), name)
    assert isinstance(handler, base) and type(handler) is not base
    assert [r.status for r in result.responses] == [200], result.responses[0].error
    assert check(result.responses[0].body) is not False, result.responses[0].body


def _module_of(name: str) -> str:
    modules = {"BaseHandler": "base_handler", "VisionHandler": "vision_handler",
               "ImageClassifier": "image_classifier", "ImageSegmenter": "image_segmenter",
               "ObjectDetector": "object_detector", "TextHandler": "text_handler",
               "TextClassifier": "text_classifier", "DenseNetHandler": "densenet_handler",
               "BaseDeepSpeedHandler": "distributed.base_deepspeed_handler"}
    return f"ts.torch_handler.{modules[name]}"


@pytest.mark.parametrize("name", list(OPTIONAL))
def test_a_subclass_of_a_class_whose_package_is_missing_fails_to_load_naming_it(
        tmp_path: Path, name: str) -> None:
    module, package = OPTIONAL[name]
    if installed(package):
        pytest.skip(f"{package} is installed here")
    folder = tmp_path / "model"
    folder.mkdir()
    write(folder, "handler.py", f"""
        from ts.torch_handler.{module} import {name}


        class Handler({name}):
            pass
        """)

    with pytest.raises(HandlerLoadError, match=f"needs {package}.*not installed"):
        load(folder, "handler.py")


def test_a_handler_named_as_torchserve_names_its_own_is_found_in_ts_torch_handler(
        tmp_path: Path) -> None:
    """TorchServe resolves ``--handler densenet_handler`` to ts.torch_handler's module; so
    does the worker (for names that are not batchserve's built-ins)."""
    folder = tmp_path / "model"
    folder.mkdir()
    entries = save_model(folder, LINEAR, "TinyLinear")
    buffer = io.BytesIO()
    torch.save(torch.ones(4), buffer)

    service = load(folder, "densenet_handler", entries)
    result = service.predict(batch(buffer.getvalue()))

    assert type(handler_of(service)).__name__ == "DenseNetHandler"
    assert result.responses[0].status == 200
    if not installed("vllm"):
        with pytest.raises(HandlerLoadError, match=r"ts\.torch_handler\.vllm_handler.*needs vllm"):
            load(folder, "vllm_handler")


def test_an_async_handle_runs_on_the_worker_event_loop(tmp_path: Path) -> None:
    """TorchServe's async handlers (its vLLM and TensorRT-LLM ones) define ``async def
    handle``; the worker runs each call to its end, on one event loop across batches."""
    folder = tmp_path / "model"
    folder.mkdir()
    write(folder, "handler.py", """
        import asyncio

        from ts.torch_handler.base_handler import BaseHandler


        class Handler(BaseHandler):
            def initialize(self, context):
                self.loops = []
                self.initialized = True

            async def handle(self, data, context):
                await asyncio.sleep(0)
                self.loops.append(asyncio.get_running_loop())
                return [row["body"].upper() for row in data]
        """)
    service = load(folder, "handler.py")

    first = service.predict(batch(b"a", b"b"))
    second = service.predict(batch(b"c"))

    assert [r.body for r in first.responses] == [b"A", b"B"]
    assert [r.body for r in second.responses] == [b"C"]
    handler = handler_of(service)
    loop = handler.loops[0]
    # The worker's loop lives as long as its process; here, the test's thread gives it back.
    asyncio.set_event_loop(None)
    loop.close()
    assert len(handler.loops) == 2 and handler.loops[1] is loop


def test_torchserve_handler_tests_run_as_written_with_mock_context(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TorchServe's own BaseHandler tests (and its examples' tests) build a MockContext and
    call initialize and handle themselves; they work the same with batchserve's ts."""
    import shutil

    from ts.torch_handler.base_handler import BaseHandler
    from ts.torch_handler.unit_tests.models import base_model
    from ts.torch_handler.unit_tests.test_utils.mock_context import MockContext

    shutil.copyfile(base_model.__file__, tmp_path / "model.py")
    base_model.save_pt_file(str(tmp_path / "model.pt"))
    context = MockContext(model_name="mnist", model_dir=str(tmp_path), model_file="model.py")
    handler = BaseHandler()
    handler.initialize(context)

    assert handler.handle([[1.0, 2.0]], context) == [1]
    assert handler.handle([[1.0, 2.0], [4.0, 3.0]], context) == [1, 0]
    traces = tmp_path / "traces"
    handler.profiler_args = {"activities": [torch.profiler.ProfilerActivity.CPU],
                             "on_trace_ready": torch.profiler.tensorboard_trace_handler(
                                 str(traces))}
    monkeypatch.setenv("ENABLE_TORCH_PROFILER", "1")
    assert handler.handle([[1.0, 2.0], [4.0, 3.0]], context) == [1, 0]
    assert list(traces.iterdir())  # the profiler's trace was written
