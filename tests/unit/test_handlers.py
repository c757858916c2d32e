"""The built-in vision handlers, driven as the worker drives them: load_service + predict.

Every model here is built by the test (no downloads): tiny ones, and the ResNet-152 example
with the weights its make_weights.py generates.
"""

from __future__ import annotations

import base64
import io
import json
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from backend.errors import ModelLoadError
from backend.handlers.text_classifier import normalise, with_ngrams
from backend.service.model_service import ModelService, load_service
from protos import worker_pb2

REPO = Path(__file__).resolve().parents[2]
RESNET_EXAMPLE = REPO / "examples" / "image_classifier" / "resnet_152_batch"

TINY_CLASSIFIER = """
    import torch
    from torch import nn


    class TinyClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, kernel_size=5, stride=4)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(8, 3)

        def forward(self, x):
            return self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))
"""

# Wrappers around torchvision's smallest detection and segmentation models, as a user's
# model.py would define them (one nn.Module subclass; the rest is imported).
TINY_DETECTOR = """
    from torch import nn
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn


    class TinyDetector(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = fasterrcnn_mobilenet_v3_large_320_fpn(
                weights=None, weights_backbone=None, num_classes=3
            )

        def forward(self, images):
            return self.net(images)
"""

TINY_SEGMENTER = """
    from torch import nn
    from torchvision.models.segmentation import lraspp_mobilenet_v3_large


    class TinySegmenter(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = lraspp_mobilenet_v3_large(
                weights=None, weights_backbone=None, num_classes=3
            )

        def forward(self, images):
            return self.net(images)
"""

TINY_TEXT_CLASSIFIER = """
    from torch import nn


    class TinyTextClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.EmbeddingBag(12, 4, mode="mean")
            self.fc = nn.Linear(4, 2)

        def forward(self, text, offsets):
            return self.fc(self.embedding(text, offsets))
"""

LABELS = {"0": ["n00000000", "tench"], "1": ["n00000001", "goldfish"], "2": "shark"}


@pytest.fixture(autouse=True)
def restore_import_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Restore sys.path and forget the modules imported from model directories or examples."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    # A handler may lift Pillow's process-wide limit (limit_max_image_pixels=false).
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)
    yield
    for name, module in list(sys.modules.items()):
        origin = str(getattr(module, "__file__", None) or "")
        if origin.startswith((str(tmp_path), str(RESNET_EXAMPLE))):
            del sys.modules[name]


# --- building archives and requests ----------------------------------------------------------


def model_class(model_dir: Path) -> type[torch.nn.Module]:
    """The model class of model_dir/model.py, to build the state dict the archive ships."""
    namespace: dict[str, Any] = {"__name__": "model_under_test"}
    exec((model_dir / "model.py").read_text(), namespace)
    (cls,) = [
        value
        for value in namespace.values()
        if isinstance(value, type)
        and issubclass(value, torch.nn.Module)
        and value.__module__ == "model_under_test"
    ]
    return cls


def eager_model_dir(
    tmp_path: Path,
    source: str = TINY_CLASSIFIER,
    *,
    labels: dict[str, Any] | None = LABELS,
    prepare: Callable[[Any], None] | None = None,
) -> Path:
    """model.py + a seeded state dict model.pt (+ index_to_name.json) in a model directory."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "model.py").write_text(textwrap.dedent(source))
    torch.manual_seed(0)
    model = model_class(model_dir)()
    if prepare is not None:
        prepare(model)
    torch.save(model.state_dict(), model_dir / "model.pt")
    if labels is not None:
        (model_dir / "index_to_name.json").write_text(json.dumps(labels))
    return model_dir


def manifest(handler: str, *, model_file: str | None = "model.py") -> str:
    model: dict[str, str] = {
        "modelName": "tiny",
        "handler": handler,
        "serializedFile": "model.pt",
    }
    if model_file:
        model["modelFile"] = model_file
    return json.dumps({"runtime": "python", "model": model})


def load(
    model_dir: Path, handler: str = "image_classifier", *, batch_size: int = 8, **fields: Any
) -> ModelService:
    values: dict[str, Any] = {
        "model_name": "tiny",
        "model_version": "1.0",
        "model_dir": str(model_dir),
        "handler": handler,
        "batch_size": batch_size,
        "gpu_id": -1,
        "manifest_json": manifest(handler),
        "limit_max_image_pixels": True,
        "decode_input_request": True,
        "server_version": "0.1.0",
    }
    values.update(fields)
    return load_service(worker_pb2.LoadModel(**values))


def handler_of(service: ModelService) -> Any:
    return service.entry_point.handle.__self__  # type: ignore[attr-defined]


def count_forward_calls(service: ModelService) -> list[int]:
    """Record the batch size of every forward call of the service's model."""
    sizes: list[int] = []

    def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        sizes.append(len(args[-1]))  # the images, or the text classifier's offsets

    handler_of(service).model.register_forward_hook(hook)
    return sizes


def image(seed: int, size: tuple[int, int] = (64, 48), fmt: str = "JPEG") -> bytes:
    """A small noisy picture, different for each seed."""
    rng = np.random.default_rng(seed)
    width, height = size
    base = rng.integers(0, 256, size=3, dtype=np.uint8)
    noise = rng.integers(0, 64, size=(height, width, 3), dtype=np.uint8)
    picture = Image.fromarray((base + noise).astype(np.uint8), "RGB")
    if fmt == "PNG-RGBA":
        picture, fmt = picture.convert("RGBA"), "PNG"
    buffer = io.BytesIO()
    picture.save(buffer, fmt)
    return buffer.getvalue()


def request(
    body: bytes, *, name: str = "body", content_type: str | None = None
) -> worker_pb2.Request:
    req = worker_pb2.Request(inputs={name: body})
    if content_type is not None:
        req.content_types[name] = content_type
    return req


def batch(*requests: worker_pb2.Request) -> worker_pb2.PredictBatch:
    """The requests as one batch, with ids r0, r1, ..."""
    for index, req in enumerate(requests):
        req.request_id = f"r{index}"
    return worker_pb2.PredictBatch(batch_id=1, requests=list(requests))


def predictions(result: worker_pb2.PredictResult) -> list[Any]:
    assert all(r.status == 200 and not r.error for r in result.responses), result
    return [json.loads(r.body) for r in result.responses]


def assert_same_prediction(a: dict[str, float], b: dict[str, float], tolerance: float) -> None:
    assert list(a) == list(b)
    for label in a:
        assert a[label] == pytest.approx(b[label], abs=tolerance)


# --- image classifier ------------------------------------------------------------------------


def test_classifier_gives_top_labels_per_image(tmp_path: Path) -> None:
    service = load(eager_model_dir(tmp_path))
    bodies = [image(1), image(2, (300, 200)), image(3, (20, 30), "PNG"), image(4, fmt="PNG-RGBA")]

    result = service.predict(batch(*(request(b) for b in bodies)))

    for response, prediction in zip(result.responses, predictions(result), strict=True):
        assert response.content_type == "application/json"
        # Only 3 classes: top-5 becomes top-3, named through index_to_name.json.
        assert set(prediction) == {"tench", "goldfish", "shark"}
        probabilities = list(prediction.values())
        assert probabilities == sorted(probabilities, reverse=True)
        assert sum(probabilities) == pytest.approx(1.0, abs=1e-5)
    # As TorchServe's built-in handlers, it reports HandlerTime (and the service
    # PredictionTime), once per batch.
    assert [metric.name for metric in result.metrics] == ["HandlerTime", "PredictionTime"]


def test_classifier_runs_one_forward_pass_per_batch(tmp_path: Path) -> None:
    service = load(eager_model_dir(tmp_path))
    sizes = count_forward_calls(service)

    service.predict(batch(*(request(image(seed)) for seed in range(8))))

    assert sizes == [8]


def test_batched_result_equals_single_image_results(tmp_path: Path) -> None:
    service = load(eager_model_dir(tmp_path))
    bodies = [image(seed, (40 + 10 * seed, 90)) for seed in range(6)]

    alone = [predictions(service.predict(batch(request(b))))[0] for b in bodies]
    together = predictions(service.predict(batch(*(request(b) for b in bodies))))

    for single, batched in zip(alone, together, strict=True):
        assert_same_prediction(single, batched, 1e-5)


def test_topk_and_labels_without_index_to_name(tmp_path: Path) -> None:
    service = load(eager_model_dir(tmp_path, labels=None))
    handler_of(service).set_max_result_classes(2)

    (prediction,) = predictions(service.predict(batch(request(image(0)))))

    assert len(prediction) == 2
    assert set(prediction) <= {"0", "1", "2"}


def test_bad_images_fail_only_their_own_requests(tmp_path: Path) -> None:
    service = load(eager_model_dir(tmp_path))
    sizes = count_forward_calls(service)
    jpeg = image(5, (80, 80))
    requests = [
        request(image(0)),
        request(jpeg[: len(jpeg) // 2]),  # truncated
        request(image(1)),
        request(b""),
        request(b"just some notes\n", content_type="text/plain"),
        request(image(2)),
        request(b"GIF89a is what this claims to be\x00\x01"),
        request(image(3), name="data"),
    ]

    result = service.predict(batch(*requests))

    failed = {
        index: (r.status, r.error_type, r.error)
        for index, r in enumerate(result.responses)
        if r.error
    }
    assert sorted(failed) == [1, 3, 4, 6]
    assert all(status == 400 and kind == "InvalidInput" for status, kind, _ in failed.values())
    assert failed[1][2].startswith("corrupt or truncated image: OSError: image file is truncated")
    assert failed[3][2].startswith("empty body: the request carries no image")
    assert failed[4][2].startswith("the input is text, not an image")
    assert failed[6][2].startswith("not an image: 34 bytes in no format Pillow can read")
    for index in (0, 2, 5, 7):
        response = result.responses[index]
        assert response.status == 200
        assert set(json.loads(response.body)) == {"tench", "goldfish", "shark"}
    assert sizes == [4]  # the model saw only the good images, in one pass


def test_batch_of_only_bad_images_never_runs_the_model(tmp_path: Path) -> None:
    service = load(eager_model_dir(tmp_path))
    sizes = count_forward_calls(service)

    result = service.predict(batch(request(b""), request(b"%PDF-1.7")))

    assert [r.status for r in result.responses] == [400, 400]
    assert sizes == []


def test_too_many_pixels_is_a_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    service = load(eager_model_dir(tmp_path))
    # Above the 224x224 crop, which Pillow checks against the limit too.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 120_000)

    result = service.predict(
        batch(
            request(image(0, (300, 300))),  # 90_000 pixels: fine
            request(image(1, (400, 400))),  # 160_000: over the limit (Pillow only warns)
            request(image(2, (600, 600))),  # 360_000: over twice the limit (Pillow refuses)
        )
    )

    ok, warned, refused = result.responses
    assert ok.status == 200
    for response in (warned, refused):
        assert response.status == 400
        assert response.error.startswith("image has too many pixels")


def test_pixel_limit_can_be_lifted(tmp_path: Path) -> None:
    load(eager_model_dir(tmp_path), limit_max_image_pixels=False)

    assert Image.MAX_IMAGE_PIXELS is None


def test_base64_and_form_field_inputs(tmp_path: Path) -> None:
    service = load(eager_model_dir(tmp_path))
    raw = image(7)
    encoded = base64.b64encode(raw).decode()
    wrapped = "\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76))

    result = service.predict(
        batch(
            request(raw),
            request(raw, name="data", content_type="image/jpeg"),  # multipart form field
            request(encoded.encode(), content_type="text/plain"),
            request(wrapped.encode(), name="data", content_type="text/plain; charset=utf-8"),
            request(json.dumps({"data": encoded}).encode(), content_type="application/json"),
            request(json.dumps({"body": encoded}).encode(), content_type="application/json"),
            request(f"data:image/jpeg;base64,{encoded}".encode(), content_type="text/plain"),
        )
    )

    first, *others = predictions(result)
    for other in others:
        assert_same_prediction(first, other, 1e-6)


def test_base64_text_that_comes_as_bytes_is_an_image(tmp_path: Path) -> None:
    """A KServe v2 BYTES tensor from JSON holds base64 text (TorchServe's kservev2 envelope hands
    it on as text and its vision handler decodes it); it reaches a native v2 row as bytes, under
    the input's name. Both, and a bare base64 body without a content type, are images."""
    service = load(eager_model_dir(tmp_path))
    encoded = base64.b64encode(image(7)).decode()

    def v2(name: str) -> worker_pb2.Request:
        body = {"inputs": [{"name": name, "shape": [1], "datatype": "BYTES", "data": [encoded]}]}
        return worker_pb2.Request(inputs={"body": json.dumps(body).encode()},
                                  tensor_format=worker_pb2.TENSOR_FORMAT_REST)

    raw, named_data, named_other, bare = service.predict(
        batch(request(image(7)), v2("data"), v2("input-0"), request(encoded.encode()))).responses
    expected = json.loads(raw.body)
    for response in (named_data, named_other):
        assert response.status == 200, response.error
        outputs = {o["name"]: o["data"][0] for o in json.loads(response.body)["outputs"]}
        assert_same_prediction(expected, outputs, 1e-6)
    assert bare.status == 200, bare.error
    assert_same_prediction(expected, json.loads(bare.body), 1e-6)


def test_json_that_holds_no_image_is_a_bad_input(tmp_path: Path) -> None:
    service = load(eager_model_dir(tmp_path))

    result = service.predict(
        batch(
            request(b"[1, 2, 3]", content_type="application/json"),
            request(b'{"instances": []}', content_type="application/json"),
        )
    )

    listed, empty = result.responses
    assert (listed.status, listed.error) == (
        400,
        "expected an image as bytes or base64 text, got a JSON list",
    )
    assert empty.status == 400
    assert empty.error.startswith("empty body")


def test_torchscript_archive_loads(tmp_path: Path) -> None:
    model_dir = eager_model_dir(tmp_path)
    eager = load(model_dir)
    scripted_dir = tmp_path / "scripted"
    scripted_dir.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates TorchScript
        torch.jit.save(torch.jit.script(handler_of(eager).model), scripted_dir / "model.pt")
    (scripted_dir / "index_to_name.json").write_text(json.dumps(LABELS))
    scripted = load(scripted_dir, manifest_json=manifest("image_classifier", model_file=None))
    bodies = [request(image(seed)) for seed in range(3)]

    expected = predictions(eager.predict(batch(*bodies)))
    actual = predictions(scripted.predict(batch(*bodies)))

    assert isinstance(handler_of(scripted).model, torch.jit.ScriptModule)
    for a, b in zip(expected, actual, strict=True):
        assert_same_prediction(a, b, 1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: (d / "model.pt").unlink(), "serializedFile 'model.pt' is not in"),
        (lambda d: (d / "model.pt").write_bytes(b"junk"), "cannot load the state dict model.pt"),
        (
            lambda d: torch.save({"fc.weight": torch.zeros(1)}, d / "model.pt"),
            "model.pt does not fit TinyClassifier",
        ),
        (
            lambda d: (d / "model.py").write_text(
                "import torch\nclass A(torch.nn.Module): pass\nclass B(torch.nn.Module): pass\n"
            ),
            r"model.py must define exactly one torch.nn.Module subclass, found 2 \(A, B\)",
        ),
        (
            lambda d: (d / "index_to_name.json").write_text('{"0": 5}'),
            "the label of class '0' must be a string",
        ),
    ],
    ids=["no-weights", "junk-weights", "wrong-keys", "two-classes", "bad-labels"],
)
def test_model_load_errors_are_clear(tmp_path: Path, change: Any, message: str) -> None:
    model_dir = eager_model_dir(tmp_path)
    change(model_dir)

    with pytest.raises(ModelLoadError, match=message):
        load(model_dir)


def test_torchscript_without_model_file_needs_torchscript(tmp_path: Path) -> None:
    model_dir = eager_model_dir(tmp_path)

    with pytest.raises(ModelLoadError, match=r"cannot load model\.pt as TorchScript"):
        load(model_dir, manifest_json=manifest("image_classifier", model_file=None))


# --- object detector and segmenter ----------------------------------------------------------


def favour_class_one(model: torch.nn.Module) -> None:
    """Make the untrained detector sure that every proposal is of class 1."""
    with torch.no_grad():
        model.net.roi_heads.box_predictor.cls_score.bias.copy_(torch.tensor([-8.0, 8.0, -8.0]))


def test_object_detector_returns_labelled_boxes_above_the_threshold(tmp_path: Path) -> None:
    labels = {"object_type_names": ["__background__", "cat", "dog"]}
    model_dir = eager_model_dir(tmp_path, TINY_DETECTOR, labels=labels, prepare=favour_class_one)
    service = load(model_dir, "object_detector")
    sizes = count_forward_calls(service)

    result = service.predict(
        batch(request(image(0, (120, 90))), request(b"oops"), request(image(1, (60, 100))))
    )

    first, bad, second = result.responses
    assert bad.status == 400
    assert sizes == [2]  # the two good images, of different sizes, in one call
    for response, (width, height) in ((first, (120, 90)), (second, (60, 100))):
        detections = json.loads(response.body)
        assert detections, "the biased detector should find something"
        for detection in detections:
            assert set(detection) == {"cat", "score"}
            x1, y1, x2, y2 = detection["cat"]
            assert -1e-3 <= x1 <= x2 <= width + 1e-3 and -1e-3 <= y1 <= y2 <= height + 1e-3
            assert detection["score"] >= 0.5


def test_image_segmenter_returns_class_and_probability_per_pixel(tmp_path: Path) -> None:
    service = load(eager_model_dir(tmp_path, TINY_SEGMENTER), "image_segmenter")

    result = service.predict(batch(request(image(0, (300, 260))), request(b"")))

    good, bad = result.responses
    assert bad.status == 400
    pixels = torch.tensor(json.loads(good.body))
    assert pixels.shape == (224, 224, 2)
    classes, probabilities = pixels[..., 0], pixels[..., 1]
    assert set(classes.unique().tolist()) <= {0.0, 1.0, 2.0}
    assert bool(((probabilities > 1 / 3 - 1e-6) & (probabilities <= 1.0)).all())


# --- text classifier ------------------------------------------------------------------------


def test_text_is_normalised_as_torchserve_does() -> None:
    words = normalise(
        "<p>I can't believe it&amp;s NOT the Café\u2019s &quot;best&quot;, they're sure!</p>"
    )

    assert words == [
        "i", "cannot", "believe", "its", "not", "the", "cafes", "best", "they", "are", "sure"
    ]  # fmt: skip
    assert with_ngrams(["a", "b", "c"], 2) == ["a", "b", "c", "a b", "b c"]


def test_text_classifier_batches_and_rejects_bad_texts(tmp_path: Path) -> None:
    model_dir = eager_model_dir(
        tmp_path, TINY_TEXT_CLASSIFIER, labels={"0": "Negative", "1": "Positive"}
    )
    vocab = ["<unk>", "the", "movie", "was", "great", "not", "bad", "the movie", "movie was"]
    torch.save(vocab, model_dir / "source_vocab.pt")
    service = load(model_dir, "text_classifier")
    sizes = count_forward_calls(service)
    texts = [b"The movie was GREAT!", b"<b>was not</b> bad", "très bien".encode()]

    alone = [predictions(service.predict(batch(request(text))))[0] for text in texts]
    result = service.predict(
        batch(
            request(texts[0], content_type="text/plain"),
            request(b""),
            request(texts[1]),
            request(b"\xff\xfe"),
            request(texts[2], name="data"),
        )
    )

    first, empty, second, binary, third = result.responses
    assert (empty.status, empty.error) == (400, "empty body: the request carries no text")
    assert binary.status == 400
    assert binary.error.startswith("the text is not UTF-8")
    for single, response in zip(alone, (first, second, third), strict=True):
        assert response.status == 200
        prediction = json.loads(response.body)
        assert list(prediction) == ["Negative", "Positive"]
        assert sum(prediction.values()) == pytest.approx(1.0)
        assert_same_prediction(single, prediction, 1e-6)
    assert sizes == [1, 1, 1, 3]


def test_text_classifier_needs_a_plain_vocabulary(tmp_path: Path) -> None:
    model_dir = eager_model_dir(tmp_path, TINY_TEXT_CLASSIFIER)

    with pytest.raises(ModelLoadError, match=r"needs its vocabulary, source_vocab\.pt"):
        load(model_dir, "text_classifier")
    torch.save({"the": "0"}, model_dir / "source_vocab.pt")
    with pytest.raises(ModelLoadError, match=r"holds a dict, not a \{token: index\} dict"):
        load(model_dir, "text_classifier")


# --- the ResNet-152 example -----------------------------------------------------------------
# Marked slow: the real model (weights, load and the images) takes about 8 s a test on a 2-core
# CPU.


@pytest.mark.slow
def test_resnet152_example_batches_consistently(tmp_path: Path) -> None:
    sys.path.insert(0, str(RESNET_EXAMPLE))
    from make_weights import write_weights  # the example's own script

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    write_weights(model_dir / "resnet152.pt")
    for name in ("model.py", "index_to_name.json"):
        (model_dir / name).write_bytes((RESNET_EXAMPLE / name).read_bytes())
    service = load(
        model_dir,
        manifest_json=json.dumps(
            {
                "model": {
                    "modelName": "resnet-152-batch_v2",
                    "handler": "image_classifier",
                    "modelFile": "model.py",
                    "serializedFile": "resnet152.pt",
                }
            }
        ),
    )
    images = {
        name: (RESNET_EXAMPLE / f"{name}.jpg").read_bytes() for name in ("kitten", "dog", "croco")
    }
    order = ["kitten", "dog", "croco", "dog", "kitten", "croco", "croco", "kitten"]

    alone = {
        name: predictions(service.predict(batch(request(body))))[0] for name, body in images.items()
    }
    mixed = predictions(service.predict(batch(*(request(images[name]) for name in order))))

    for name, prediction in zip(order, mixed, strict=True):
        assert_same_prediction(alone[name], prediction, 1e-4)
    # The calibrated random weights answer like a classifier: unsure, and per picture.
    assert all(0.3 < max(prediction.values()) < 0.7 for prediction in alone.values())
    assert len({frozenset(prediction) for prediction in alone.values()}) == 3


@pytest.mark.slow
def test_resnet152_tensor_and_pil_decoding_agree(tmp_path: Path) -> None:
    """The documented tolerance between ``image_decode: tensor`` (the default) and Pillow's
    pixel-exact TorchServe path: the same top-5 labels, probabilities within 2e-3."""
    sys.path.insert(0, str(RESNET_EXAMPLE))
    from make_weights import write_weights

    services = {}
    for mode in ("tensor", "pil"):
        model_dir = tmp_path / mode
        model_dir.mkdir()
        if not services:
            write_weights(model_dir / "resnet152.pt")
        else:
            (model_dir / "resnet152.pt").write_bytes((tmp_path / "tensor" / "resnet152.pt")
                                                     .read_bytes())
        for name in ("model.py", "index_to_name.json"):
            (model_dir / name).write_bytes((RESNET_EXAMPLE / name).read_bytes())
        (model_dir / "model-config.yaml").write_text(f"handler:\n  image_decode: {mode}\n")
        services[mode] = load(model_dir, manifest_json=json.dumps({"model": {
            "modelName": "resnet", "handler": "image_classifier", "modelFile": "model.py",
            "serializedFile": "resnet152.pt", "configFile": "model-config.yaml"}}))
        assert handler_of(services[mode]).pipeline.mode == mode
    images = [(RESNET_EXAMPLE / f"{name}.jpg").read_bytes() for name in ("kitten", "dog", "croco")]
    answers = {mode: predictions(service.predict(batch(*(request(i) for i in images))))
               for mode, service in services.items()}
    for tensor_answer, pil_answer in zip(answers["tensor"], answers["pil"], strict=True):
        assert_same_prediction(tensor_answer, pil_answer, 2e-3)


def test_a_batch_prepared_ahead_answers_as_one_run_whole(tmp_path: Path) -> None:
    service = load(eager_model_dir(tmp_path))
    requests_ = [request(image(1)), request(b"not an image"), request(image(2, fmt="PNG"))]
    whole = service.predict(batch(*requests_))

    prepared = service.prepare(batch(*requests_))
    assert prepared is not None  # the vision handler decodes ahead
    ahead = service.predict(batch(*requests_), prepared)

    assert [(r.status, r.body, r.error) for r in ahead.responses] == [
        (r.status, r.body, r.error) for r in whole.responses]
    assert [r.status for r in ahead.responses] == [200, 400, 200]


def test_handlers_without_a_prepare_step_are_not_prepared(tmp_path: Path) -> None:
    from tests.unit.test_backend_service import load_message, model_dir_with

    echo = load_service(load_message(model_dir_with(tmp_path, "echo.py"), "echo.py"))
    assert echo.prepare(batch(request(b"x"))) is None
