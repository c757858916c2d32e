"""Images and tiny-model archives for the vision tests (made by code, nothing downloaded)."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import torch
from PIL import Image

from model_archiver.packaging import ArchiveOptions, build_archive
from tests.conftest import ROOT

TINY_MODEL = ROOT / "tests" / "fixtures" / "models" / "tiny_classifier.py"
LABELS = {"0": ["n0", "circle"], "1": ["n1", "square"], "2": ["n2", "stripe"]}


def jpeg(seed: int, size: tuple[int, int] = (80, 60)) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="JPEG")
    return buffer.getvalue()


def tiny_model_files(folder: Path) -> tuple[Path, Path, Path]:
    """model.py, seeded weights and index_to_name.json for the tiny classifier."""
    folder.mkdir(parents=True, exist_ok=True)
    model_file = folder / "model.py"
    shutil.copy(TINY_MODEL, model_file)
    namespace: dict[str, object] = {}
    exec(compile(TINY_MODEL.read_text(), str(TINY_MODEL), "exec"), namespace)
    torch.manual_seed(0)
    model = namespace["TinyClassifier"]()  # type: ignore[operator]
    weights = folder / "tiny.pt"
    torch.save(model.state_dict(), weights)
    labels = folder / "index_to_name.json"
    labels.write_text(json.dumps(LABELS))
    return model_file, weights, labels


def build_tiny_classifier(store: Path, name: str = "tiny") -> Path:
    model_file, weights, labels = tiny_model_files(store.parent / f"{name}-src")
    return build_archive(ArchiveOptions(
        model_name=name, version="1.0", model_file=str(model_file),
        serialized_file=str(weights), handler="image_classifier",
        extra_files=(str(labels),), export_path=store, force=True))
