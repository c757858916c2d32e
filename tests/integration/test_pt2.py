"""``.pt2`` archives through the real server (issue 37, 1): a torch.export ExportedProgram and
an AOTInductor package (``--serialized-file model.pt2``, no model file) served by the built-in
handlers and TorchServe's BaseHandler, answering as the eager archive does; batches split
across the program's dynamic batch dimension; a program without one run a request at a time;
a corrupt ``.pt2`` refused with a clear error. The programs are made once and cached
(``tests/integration/pt2_fixtures.py``: AOTInductor's compile takes about a minute).
"""

from __future__ import annotations

import json
import struct
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from model_archiver.packaging import ArchiveOptions, build_archive
from tests.conftest import ROOT, RunningServer, launch_server
from tests.integration.pt2_fixtures import programs
from tests.integration.vision_fixtures import build_tiny_classifier, jpeg, tiny_model_files

TS_HANDLER = ROOT / "tests" / "fixtures" / "ts_handlers" / "my_handler.py"
KINDS = {"ep": "export", "aoti": "aoti"}


@pytest.fixture(scope="module")
def folder() -> Path:
    return programs()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("pt2") / "model_store"
    folder.mkdir()
    return folder


@pytest.fixture(scope="module")
def server(folder: Path, store: Path) -> Iterator[RunningServer]:
    root = store.parent
    build_tiny_classifier(store, "eager")
    _, _, labels = tiny_model_files(root / "src")
    for name, kind in KINDS.items():
        _archive(store, name, folder / f"tiny.{kind}.pt2", "image_classifier", labels)
    _archive(store, "static", folder / "tinystatic.export.pt2", "image_classifier", labels)
    _archive(store, "seg", folder / "seg.export.pt2", "image_segmenter")
    _archive(store, "reg", folder / "reg.export.pt2", str(TS_HANDLER))
    config = root / "model-config.yaml"  # TorchServe's keys for an AOTInductor model
    config.write_text("pt2:\n  export:\n    aot_compile: true\n")
    _archive(store, "aoti_export_key", folder / "tiny.aoti.pt2", "image_classifier", labels,
             config)
    config.write_text("pt2:\n  compile:\n    enable: true\n")
    _archive(store, "aoti_compile_key", folder / "tiny.aoti.pt2", "image_classifier", labels,
             config)
    running = launch_server(store, "eager=eager.mar", "ep=ep.mar", "aoti=aoti.mar")
    try:
        yield running
    finally:
        running.stop()


def _archive(store: Path, name: str, serialized: Path, handler: str,
             labels: Path | None = None, config: Path | None = None) -> Path:
    return build_archive(ArchiveOptions(
        model_name=name, version="1.0", serialized_file=str(serialized), handler=handler,
        extra_files=(str(labels),) if labels else (), export_path=store, force=True,
        config_file=str(config) if config else None))


def _register(server: RunningServer, url: str, name: str, batch_size: int = 1,
              delay_ms: int = 5000) -> None:
    """``url`` as ``name``: a fixed policy's batches, released when full (or after
    ``delay_ms``: what a lone request to it waits)."""
    answer = requests.post(f"{server.management}/models", params={
        "url": url, "model_name": name, "batch_size": batch_size, "max_batch_delay": delay_ms,
        "batch_policy": "fixed", "initial_workers": 1, "synchronous": "true"}, timeout=120)
    assert answer.status_code == 200, answer.text


def _close(got: dict[str, float], want: dict[str, float], tolerance: float = 1e-3) -> bool:
    """The same classes in the same order, each probability within ``tolerance``."""
    return list(got) == list(want) and all(abs(got[k] - want[k]) <= tolerance for k in want)


def _together(server: RunningServer, model: str, bodies: list[bytes],
              content_type: str = "image/jpeg") -> list[Any]:
    """The answers to ``bodies`` sent at once (a batch, with a fixed policy's long delay)."""
    headers = {"content-type": content_type}
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda body: server.predict(model, body, headers=headers),
                                bodies))
    assert [answer.status_code for answer in answers] == [200] * len(bodies), answers[0].text
    return [answer.json() for answer in answers]


def _execution(server: RunningServer, model: str) -> dict[str, Any]:
    workers: Any = server.describe(model)["workers"]
    return workers[0]["execution"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("model", sorted(KINDS))
def test_a_pt2_archive_answers_as_the_eager_archive(server: RunningServer, model: str) -> None:
    for seed in range(3):
        want = server.predict("eager", jpeg(seed)).json()
        got = server.predict(model, jpeg(seed))
        assert got.status_code == 200, got.text
        assert _close(got.json(), want), (got.json(), want)
    execution = _execution(server, model)
    assert execution["program"].startswith(f"tiny.{KINDS[model]}.pt2: ")
    assert execution["program"].endswith("batch dimension 1..4")
    assert ("AOTInductor package" in execution["program"]) == (model == "aoti")


@pytest.mark.parametrize("model", sorted(KINDS))
def test_a_batch_larger_than_the_batch_dimension_is_split(server: RunningServer,
                                                          model: str) -> None:
    name = f"{model}_b8"
    _register(server, f"{model}.mar", name, batch_size=8)
    bodies = [jpeg(seed) for seed in range(8)]
    batched = _together(server, name, bodies)

    assert server.describe(name)["batching"]["recentBatchSizes"] == [8]  # type: ignore[index]
    lone = [server.predict("eager", body).json() for body in bodies]
    assert all(_close(got, want) for got, want in zip(batched, lone, strict=True))
    execution = _execution(server, name)
    # Within the program's 1..4 rows: the batch of 8 ran as two chunks of 4.
    assert execution["batchBuckets"] == [1, 2, 4] and execution["mode"] == "padded"


def test_a_program_without_a_batch_dimension_runs_one_request_at_a_time(
        server: RunningServer) -> None:
    _register(server, "static.mar", "static", batch_size=4)
    bodies = [jpeg(seed) for seed in range(4)]
    batched = _together(server, "static", bodies)

    lone = [server.predict("eager", body).json() for body in bodies]
    assert all(_close(got, want) for got, want in zip(batched, lone, strict=True))
    execution = _execution(server, "static")
    assert execution["batchBuckets"] == [1]
    assert "no dynamic batch dimension" in execution["program"]
    assert execution["program"].endswith("(one request at a time)")


def test_the_segmenter_serves_an_exported_program_batched(server: RunningServer,
                                                          folder: Path) -> None:
    _register(server, "seg.mar", "seg", batch_size=2, delay_ms=1500)
    bodies = [jpeg(seed) for seed in range(2)]
    batched = _together(server, "seg", bodies)

    assert len(batched[0]) == 224 and len(batched[0][0]) == 224
    lone = server.predict("seg", bodies[1]).json()
    assert torch.allclose(torch.tensor(batched[1]), torch.tensor(lone), atol=1e-5)
    classes = torch.tensor(batched[0])[..., 0]
    assert set(classes.unique().tolist()) <= {0.0, 1.0}


def test_torchserve_base_handler_serves_a_pt2(server: RunningServer, folder: Path) -> None:
    _register(server, "reg.mar", "reg", batch_size=3)
    rows = [[1.0, 2.0], [-3.0, 0.5], [0.0, 0.0]]
    answers = _together(server, "reg", [json.dumps({"x": row}).encode() for row in rows],
                        "application/json")

    state = torch.load(folder / "tiny_regressor.pt", weights_only=True)
    want = (torch.tensor(rows) @ state["weight"].T + state["bias"]).squeeze(1).tolist()
    assert [answer["y"] for answer in answers] == pytest.approx(want, abs=1e-5)
    assert "ExportedProgram" in _execution(server, "reg")["program"]


def test_the_text_classifier_serves_an_exported_program(server: RunningServer, store: Path,
                                                         folder: Path, tmp_path: Path) -> None:
    vocab = tmp_path / "source_vocab.pt"
    torch.save({"<unk>": 0, "good": 1, "bad": 2, "film": 3, "good film": 4}, vocab)
    build_archive(ArchiveOptions(
        model_name="text", version="1.0", serialized_file=str(folder / "text.export.pt2"),
        handler="text_classifier", extra_files=(str(vocab),), export_path=store, force=True))
    _register(server, "text.mar", "text", batch_size=3, delay_ms=1500)
    texts_sent = [b"good film", b"bad film, bad", b"good"]
    batched = _together(server, "text", texts_sent, "text/plain")

    lone = [server.predict("text", text).json() for text in texts_sent]
    assert all(got == pytest.approx(want, abs=1e-5) for got, want in zip(batched, lone,
                                                                         strict=True))
    assert batched[0] != batched[1] and set(batched[0]) == {"0", "1"}
    assert server.describe("text")["batching"]["recentBatchSizes"][-4:] == [3, 1, 1, 1]  # type: ignore[index]
    assert "the program takes 2 inputs" in _execution(server, "text")["program"]
    state = torch.load(folder / "text_weights.pt", weights_only=True)
    bag = torch.nn.functional.embedding_bag(torch.tensor([1, 3, 4]), state["embedding.weight"],
                                            torch.tensor([0]), mode="mean")
    want = torch.softmax(bag @ state["fc.weight"].T + state["fc.bias"], dim=1)[0].tolist()
    assert [batched[0]["0"], batched[0]["1"]] == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("name", ["aoti_export_key", "aoti_compile_key"])
def test_torchserve_pt2_model_config_keys_keep_working(server: RunningServer,
                                                       name: str) -> None:
    _register(server, f"{name}.mar", name)
    answer = server.predict(name, jpeg(0))
    assert answer.status_code == 200, answer.text
    assert _close(answer.json(), server.predict("eager", jpeg(0)).json())
    assert "AOTInductor package" in _execution(server, name)["program"]


def _corrupt(kind: str, good: Path, bad: Path) -> None:
    """``bad``: ``good`` cut in half, one weight's byte flipped, a zip of neither kind, or
    not a zip at all."""
    whole = bytearray(good.read_bytes())
    if kind == "truncated":
        bad.write_bytes(whole[:len(whole) // 2])
    elif kind == "flipped":
        with zipfile.ZipFile(good) as archive:
            entry = max(archive.infolist(), key=lambda info: info.file_size)
        name_length, extra_length = struct.unpack_from("<HH", whole, entry.header_offset + 26)
        data = entry.header_offset + 30 + name_length + extra_length
        whole[data + entry.file_size // 2] ^= 0xFF
        bad.write_bytes(whole)
    elif kind == "neither":
        with zipfile.ZipFile(bad, "w") as archive:
            archive.writestr("model/data/weights.bin", b"\0" * 64)
    else:
        bad.write_bytes(b"not a zip at all")


@pytest.mark.parametrize(("kind", "says"), [
    ("text", "is not a .pt2 archive (not a zip file"),
    ("truncated", "is not a .pt2 archive (not a zip file"),
    ("flipped", "is a damaged .pt2 archive"),
    ("neither", "holds neither a torch.export program"),
])
def test_a_corrupt_pt2_is_refused_with_a_clear_error(server: RunningServer, folder: Path,
                                                     store: Path, tmp_path: Path, kind: str,
                                                     says: str) -> None:
    bad = tmp_path / "model.pt2"
    _corrupt(kind, folder / "tiny.export.pt2", bad)
    name = f"bad_{kind}"
    _archive(store, name, bad, "image_classifier")
    answer = requests.post(f"{server.management}/models", params={
        "url": f"{name}.mar", "initial_workers": 1, "synchronous": "true"}, timeout=120)
    assert answer.status_code == 500, answer.text
    message = answer.json()["message"]
    assert "cannot load model.pt2" in message and says in message, message



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", sorted(KINDS))
def test_on_cuda_an_exported_program_runs_there_and_a_cpu_package_is_refused(
        folder: Path, model: str) -> None:
    from backend.errors import ModelLoadError
    from backend.weights.pt2 import load_pt2

    cuda = torch.device("cuda", 0)
    path = folder / f"tiny.{KINDS[model]}.pt2"
    if model == "aoti":  # the cached package was compiled for the CPU
        with pytest.raises(ModelLoadError, match="compiled by AOTInductor for cpu and this "
                                                 "worker runs on cuda:0"):
            load_pt2(path, cuda)
        return
    on_cpu, on_gpu = load_pt2(path, torch.device("cpu")), load_pt2(path, cuda)
    rows = torch.randn(3, 3, 224, 224)
    with torch.inference_mode():
        assert torch.allclose(on_gpu(rows.to(cuda)).cpu(), on_cpu(rows), atol=1e-4)
