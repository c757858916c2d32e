"""Build ``model_store/resnet-152-batch_v2.mar`` unless it is already there.

The weights are made in a temporary directory (``make_weights.py``: seeded random weights, or
``--weights PATH`` to convert a real torchvision resnet152 state dict) and packed with
batchserve's model archiver, as the README's ``model-archiver`` command would::

    python examples/image_classifier/resnet_152_batch/build_mar.py --model-store model_store
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from make_weights import write_weights  # noqa: E402  (the script next to this one)

from model_archiver.packaging import (  # noqa: E402
    ArchiveFormat,
    ArchiveOptions,
    archive_path,
    build_archive,
)

MODEL_NAME = "resnet-152-batch_v2"
VERSION = "2.0"
DEFAULT_MODEL_STORE = HERE.parents[2] / "model_store"


def archive_options(model_store: Path, weights: Path, *, force: bool = False) -> ArchiveOptions:
    return ArchiveOptions(
        model_name=MODEL_NAME,
        version=VERSION,
        model_file=str(HERE / "model.py"),
        serialized_file=str(weights),
        handler="image_classifier",
        extra_files=(str(HERE / "index_to_name.json"),),
        export_path=model_store,
        # Stored, not deflated: 240 MB of float weights barely compress, and zipping them
        # takes seconds. Still a plain zip that TorchServe reads.
        archive_format=ArchiveFormat.ZIP_STORE,
        force=force,
    )


def build_mar(
    model_store: Path = DEFAULT_MODEL_STORE, *, weights: Path | None = None, force: bool = False
) -> tuple[Path, bool]:
    """The archive's path, and whether it was built now (False: it was already there)."""
    return build_once(model_store, archive_options, write_weights, "resnet152.pt",
                      weights=weights, force=force)


def build_once(model_store: Path, options: Callable[..., ArchiveOptions],
               write: Callable[..., Path], file_name: str, *, weights: Path | None,
               force: bool) -> tuple[Path, bool]:
    """An example's archive built from ``options(model_store, weights_file)`` with the
    weights ``write`` makes, unless it is there (the ResNet-50 example builds its own so)."""
    model_store.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="example-weights-") as tmp:
        target = archive_path(options(model_store, Path(tmp) / file_name))
        if target.exists() and not force:
            return target, False
        state_dict = write(Path(tmp) / file_name, weights=weights)
        return build_archive(options(model_store, state_dict, force=force)), True


def main(argv: Sequence[str] | None = None, build: Callable[..., tuple[Path, bool]] = build_mar,
         doc: str | None = __doc__, model: str = "resnet152") -> int:
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--model-store", type=Path, default=DEFAULT_MODEL_STORE)
    parser.add_argument("--weights", type=Path, help=f"a real torchvision {model} state dict")
    parser.add_argument("--force", action="store_true", help="rebuild an existing archive")
    args = parser.parse_args(argv)
    path, built = build(args.model_store, weights=args.weights, force=args.force)
    print(f"{'built' if built else 'already there:'} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
