"""Build ``model_store/resnet-50.mar`` unless it is already there.

torchvision's ResNet-50 (``model.py``) with seeded random weights, calibrated as the
ResNet-152 example's ``make_weights.py`` calibrates its own (each picture its own top-5), or
``--weights PATH`` to convert a real torchvision resnet50 state dict; the built-in
``image_classifier`` handler and the ImageNet labels of ``../resnet_152_batch``::

    python examples/image_classifier/resnet_50/build_mar.py --model-store model_store
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

HERE = Path(__file__).resolve().parent
RESNET_152 = HERE.parent / "resnet_152_batch"
sys.path.insert(0, str(HERE.parents[2]))  # the repository, for model_archiver
from model_archiver.packaging import ArchiveFormat, ArchiveOptions  # noqa: E402

MODEL_NAME = "resnet-50"
VERSION = "1.0"
DEFAULT_MODEL_STORE = HERE.parents[2] / "model_store"


def _load(name: str, path: Path) -> ModuleType:
    """A module by its path, under a name of its own (both examples have a ``model.py``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_weights(output: Path, *, weights: Path | None = None, seed: int = 0) -> Path:
    """The state dict, written to ``output`` (atomically)."""
    model_class = _load("resnet50_model", HERE / "model.py").ResNet50ImageClassifier
    if weights is not None:
        model = model_class()
        model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        state_dict = model.state_dict()
    else:
        calibration = _load("resnet152_make_weights", RESNET_152 / "make_weights.py")
        state_dict = calibration.random_weights(seed, model_class=model_class)
    partial = output.with_name(f".{output.name}.partial")
    torch.save(state_dict, partial)
    os.replace(partial, output)
    return output


def archive_options(model_store: Path, weights: Path, *, force: bool = False) -> ArchiveOptions:
    return ArchiveOptions(
        model_name=MODEL_NAME,
        version=VERSION,
        model_file=str(HERE / "model.py"),
        serialized_file=str(weights),
        handler="image_classifier",
        extra_files=(str(RESNET_152 / "index_to_name.json"),),
        export_path=model_store,
        archive_format=ArchiveFormat.ZIP_STORE,  # 100 MB of weights barely compress
        force=force,
    )


def build_mar(
    model_store: Path = DEFAULT_MODEL_STORE, *, weights: Path | None = None, force: bool = False
) -> tuple[Path, bool]:
    """The archive's path, and whether it was built now (False: it was already there)."""
    return _load("resnet152_build_mar", RESNET_152 / "build_mar.py").build_once(
        model_store, archive_options, write_weights, "resnet50.pt", weights=weights,
        force=force)


def main(argv: Sequence[str] | None = None) -> int:
    cli = _load("resnet152_build_mar", RESNET_152 / "build_mar.py").main
    return int(cli(argv, build=build_mar, doc=__doc__, model="resnet50"))


if __name__ == "__main__":
    sys.exit(main())
