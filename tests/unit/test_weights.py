"""backend.weights: eager weights memory-mapped onto modules built with empty parameters,
safetensors files, TorchScript tensors mapped back onto their archive, and the
``share_weights`` switch. Where a tensor's memory is, is read from /proc/self/maps."""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file, save_model

from backend.errors import ModelLoadError
from backend.weights import Sharing, load_eager, load_model, load_torchscript, read_sharing
from backend.weights.empty import assign_state_dict, parameters_on_meta

CPU = torch.device("cpu")

MODEL = """
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.norm = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 4)
        # A non-persistent buffer (not in the state dict) made from plain numbers.
        self.register_buffer("scale", torch.arange(4.0) + 1, persistent=False)

    def forward(self, x):
        y = self.norm(self.conv(x)).mean(dim=(2, 3))
        return self.head(y) * self.scale
"""


def mapping_of(tensor: torch.Tensor) -> str | None:
    """The file the memory of ``tensor`` is mapped from (None: anonymous memory)."""
    address = tensor.untyped_storage().data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        low, high = (int(part, 16) for part in fields[0].split("-"))
        if low <= address < high:
            return fields[5] if len(fields) > 5 and fields[5].startswith("/") else None
    return None


def model_class(folder: Path, source: str = MODEL) -> tuple[Path, type[torch.nn.Module]]:
    path = folder / "model.py"
    path.write_text(textwrap.dedent(source))
    namespace: dict[str, object] = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return path, namespace["Net"]  # type: ignore[return-value]


def trained(cls: type[torch.nn.Module]) -> torch.nn.Module:
    torch.manual_seed(7)
    model = cls()
    model.train()
    with torch.no_grad():
        model(torch.randn(4, 3, 9, 9))  # batch-norm statistics that are not the defaults
    return model.eval()


def old_way(cls: type[torch.nn.Module], weights: Path) -> torch.nn.Module:
    """What the loader did before: a fully initialised model, the state dict copied in."""
    model = cls()
    model.load_state_dict(torch.load(weights, weights_only=True))
    return model.eval()


def predictions(model: torch.nn.Module) -> torch.Tensor:
    torch.manual_seed(3)
    with torch.inference_mode():
        return model.eval()(torch.randn(2, 3, 9, 9))


def test_a_state_dict_is_served_from_the_file_pages_with_the_same_predictions(
        tmp_path: Path) -> None:
    model_file, cls = model_class(tmp_path)
    weights = tmp_path / "model.pt"
    torch.save(trained(cls).state_dict(), weights)

    model = load_eager(model_file, weights, CPU)

    for name, tensor in model.state_dict().items():
        assert mapping_of(tensor) == str(weights), name
    assert torch.equal(model.scale, torch.arange(4.0) + 1)  # type: ignore[arg-type]
    assert torch.equal(predictions(model), predictions(old_way(cls, weights)))


def test_safetensors_weights_are_served_from_the_file_pages(tmp_path: Path) -> None:
    _, cls = model_class(tmp_path)
    reference = trained(cls)
    weights = tmp_path / "model.safetensors"
    save_file(reference.state_dict(), weights)

    model = load_model(tmp_path, {"model": {"modelFile": "model.py",
                                            "serializedFile": weights.name}}, CPU)

    assert mapping_of(model.head.weight) == str(weights)  # type: ignore[arg-type]
    assert torch.equal(predictions(model), predictions(reference))


def test_safetensors_are_told_by_their_content_and_tied_weights_saved_once_load(
        tmp_path: Path) -> None:
    model_file, cls = model_class(tmp_path, """
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = torch.nn.Embedding(10, 6)
                self.out = torch.nn.Linear(6, 10, bias=False)
                self.out.weight = self.embed.weight  # tied

            def forward(self, x):
                return self.out(self.embed(x))
        """)
    torch.manual_seed(1)
    reference = cls().eval()
    weights = tmp_path / "weights.bin"  # not named .safetensors
    save_model(reference, str(weights))  # writes the tied tensor once

    model = load_eager(model_file, weights, CPU)

    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        assert torch.equal(model(ids), reference(ids))
    assert mapping_of(model.out.weight) == str(weights)  # type: ignore[arg-type]


def test_a_file_in_another_dtype_is_converted_as_load_state_dict_converts(
        tmp_path: Path) -> None:
    model_file, cls = model_class(tmp_path)
    weights = tmp_path / "model.pt"
    torch.save({key: value.half() if value.is_floating_point() else value
                for key, value in trained(cls).state_dict().items()}, weights)

    model = load_eager(model_file, weights, CPU)

    assert model.conv.weight.dtype == torch.float32  # type: ignore[union-attr]
    assert torch.equal(predictions(model), predictions(old_way(cls, weights)))


def test_a_model_that_reads_its_parameters_while_built_is_built_the_ordinary_way(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model_file, cls = model_class(tmp_path, """
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.head = torch.nn.Linear(4, 2)
                self.norm = float(self.head.weight.abs().sum().item())  # needs real values

            def forward(self, x):
                return self.head(x)
        """)
    torch.manual_seed(2)
    reference = cls().eval()
    weights = tmp_path / "model.pt"
    torch.save(reference.state_dict(), weights)

    with caplog.at_level(logging.INFO, logger="backend.weights"):
        model = load_eager(model_file, weights, CPU)

    x = torch.ones(1, 4)
    assert torch.equal(model(x), reference(x))
    assert "cannot take the weights as they are" in caplog.text


def test_weights_that_do_not_fit_are_a_clear_load_error(tmp_path: Path) -> None:
    model_file, _ = model_class(tmp_path)
    weights = tmp_path / "model.pt"
    torch.save({"head.weight": torch.zeros(4, 8)}, weights)
    with pytest.raises(ModelLoadError, match=r"(?s)does not fit Net.*Missing key"):
        load_eager(model_file, weights, CPU)


def test_share_weights_false_reads_a_copy_of_its_own(tmp_path: Path) -> None:
    model_file, cls = model_class(tmp_path)
    weights = tmp_path / "model.pt"
    torch.save(trained(cls).state_dict(), weights)

    model = load_eager(model_file, weights, CPU, Sharing.COPY)

    assert mapping_of(model.conv.weight) is None  # type: ignore[arg-type]
    assert torch.equal(predictions(model), predictions(old_way(cls, weights)))


def test_a_legacy_format_file_still_loads_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model_file, cls = model_class(tmp_path)
    weights = tmp_path / "model.pt"
    torch.save(trained(cls).state_dict(), weights, _use_new_zipfile_serialization=False)

    with caplog.at_level(logging.WARNING):
        model = load_eager(model_file, weights, CPU)

    assert "legacy" in caplog.text
    assert torch.equal(predictions(model), predictions(old_way(cls, weights)))


@pytest.mark.filterwarnings("ignore:`torch.jit.[a-z]*` is deprecated:FutureWarning")
def test_torchscript_tensors_are_mapped_back_onto_the_archive(tmp_path: Path) -> None:
    _, cls = model_class(tmp_path)
    reference = trained(cls)
    archive = tmp_path / "model.pt"
    torch.jit.save(torch.jit.script(reference), str(archive))

    model = load_torchscript(archive, CPU)

    assert all(mapping_of(tensor) == str(archive) for tensor in model.state_dict().values())
    assert torch.equal(predictions(model), predictions(reference))
    copied = load_torchscript(archive, CPU, Sharing.COPY)
    assert mapping_of(next(copied.parameters())) is None


def test_parameters_built_on_meta_allocate_nothing_and_buffers_stay_real() -> None:
    with parameters_on_meta():
        layer = torch.nn.Sequential(torch.nn.Linear(50_000, 50_000), torch.nn.BatchNorm1d(3))
    assert layer[0].weight.is_meta and isinstance(layer[0].weight, torch.nn.Parameter)
    assert not layer[1].running_mean.is_meta
    # Outside the block modules are built as usual.
    assert not torch.nn.Linear(2, 2).weight.is_meta


def test_initialisers_skip_meta_tensors_inside_the_block_only() -> None:
    original = torch.nn.init.kaiming_normal_
    real = torch.zeros(4, 4)
    with parameters_on_meta():
        assert torch.nn.init.kaiming_normal_ is not original
        meta = torch.empty(4, 4, device="meta")
        assert torch.nn.init.kaiming_normal_(meta) is meta
        torch.nn.init.ones_(real)  # a real tensor is still filled
        layer = torch.nn.Linear(3, 2)
    assert torch.nn.init.kaiming_normal_ is original
    assert torch.equal(real, torch.ones(4, 4))
    assert layer.weight.is_meta and layer.bias is not None and layer.bias.is_meta


def test_shared_buffers_are_copied_when_asked() -> None:
    state = torch.nn.BatchNorm1d(3).state_dict()
    with parameters_on_meta():
        norm = torch.nn.BatchNorm1d(3)
    copied = assign_state_dict(norm, state, private_buffers=True)
    assert copied == 3  # running_mean, running_var, num_batches_tracked
    assert norm.weight.data_ptr() == state["weight"].data_ptr()
    assert norm.running_mean.data_ptr() != state["running_mean"].data_ptr()


@pytest.mark.parametrize(("value", "expected"), [
    (None, Sharing.MMAP), (True, Sharing.MMAP), ("true", Sharing.MMAP),
    (False, Sharing.COPY), ("false", Sharing.COPY), ("cuda_ipc", Sharing.CUDA_IPC),
])
def test_share_weights_is_read_from_the_model_config(value: object,
                                                     expected: Sharing) -> None:
    assert read_sharing({"handler": {"share_weights": value}}) is expected
    assert read_sharing({}) is Sharing.MMAP


def test_an_unknown_share_weights_value_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="share_weights must be true, false or cuda_ipc"):
        read_sharing({"handler": {"share_weights": "sometimes"}})


def test_safetensors_without_a_model_file_is_a_clear_load_error(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(2)}, tmp_path / "w.safetensors")
    with pytest.raises(ModelLoadError, match="holds weights only"):
        load_model(tmp_path, {"model": {"serializedFile": "w.safetensors"}}, CPU)


@pytest.mark.parametrize(("config", "mapped"), [("", True),
                                                ("handler:\n  share_weights: false\n", False)])
def test_the_built_in_handlers_share_weights_as_the_model_config_says(
        tmp_path: Path, config: str, mapped: bool) -> None:
    from tests.unit.test_handlers import eager_model_dir, handler_of, load

    model_dir = eager_model_dir(tmp_path)
    (model_dir / "model-config.yaml").write_text(config or "{}\n")
    manifest = {"runtime": "python", "model": {
        "modelName": "tiny", "handler": "image_classifier", "serializedFile": "model.pt",
        "modelFile": "model.py", "configFile": "model-config.yaml"}}

    model = handler_of(load(model_dir, manifest_json=json.dumps(manifest))).model

    expected = str(model_dir / "model.pt") if mapped else None
    assert all(mapping_of(tensor) == expected for tensor in model.state_dict().values())


def test_the_archiver_packs_safetensors_weights_that_load_mapped(tmp_path: Path) -> None:
    from model_archiver.manifest import MANIFEST_PATH
    from model_archiver.packaging import ArchiveOptions, build_archive

    model_file, cls = model_class(tmp_path)
    reference = trained(cls)
    save_file(reference.state_dict(), tmp_path / "net.safetensors")
    store = tmp_path / "store"
    store.mkdir()
    folder = build_archive(ArchiveOptions(
        model_name="net", model_file=str(model_file), handler="image_classifier",
        serialized_file=str(tmp_path / "net.safetensors"), export_path=store,
        archive_format="no-archive"))

    manifest = json.loads((folder / MANIFEST_PATH).read_text())
    assert manifest["model"]["serializedFile"] == "net.safetensors"
    model = load_model(folder, manifest, CPU)
    assert mapping_of(model.conv.weight) == str(folder / "net.safetensors")  # type: ignore[arg-type]
    assert torch.equal(predictions(model), predictions(reference))
