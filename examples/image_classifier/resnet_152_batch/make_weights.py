"""Write ``resnet152.pt``, the state dict that the ResNet-152 example archives.

No weights are downloaded. By default the weights are random (seeded: every run writes the
same values) and calibrated so that the demo answers like a classifier: each picture gets its
own top-5 labels, with a top-1 probability well below 1. With ``--weights PATH`` a real
torchvision ``resnet152`` state dict (for instance ``resnet152-394f9c45.pth``, fetched on a
machine with network access) is checked against the model and written instead::

    python make_weights.py                        # seeded random weights -> resnet152.pt
    python make_weights.py --weights resnet152-394f9c45.pth
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torchvision import transforms

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from model import ResNet152ImageClassifier  # noqa: E402  (the model file next to this script)

DEFAULT_OUTPUT = HERE / "resnet152.pt"
CALIBRATION_IMAGES = tuple(HERE / f"{name}.jpg" for name in ("kitten", "dog", "croco"))
TARGET_TOP1 = 0.5

# The image_classifier handler's preprocessing.
PREPROCESS = transforms.Compose(
    [
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)),
    ]
)


def random_weights(
    seed: int = 0,
    calibration_images: Sequence[Path] = CALIBRATION_IMAGES,
    target_top1: float = TARGET_TOP1,
    model_class: Callable[[], torch.nn.Module] = ResNet152ImageClassifier,
) -> dict[str, torch.Tensor]:
    """Seeded random weights whose answers depend on the picture.

    The pooled features of an untrained ResNet share one large component, so a random final
    layer gives every picture about the same answer. zero_init_residual (in model.py) keeps
    the features image-dependent; here the final layer is centred on the point equidistant
    from the calibration pictures' features, so that what differs between pictures decides
    the class and no picture is much more confident than another, then scaled so that their
    median top-1 probability is ``target_top1``. ``model_class``: another torchvision ResNet
    built the same way (examples/image_classifier/resnet_50 uses it).
    """
    torch.manual_seed(seed)
    model: Any = model_class().eval()
    if len(calibration_images) < 2:
        return model.state_dict()
    batch = torch.stack([PREPROCESS(Image.open(p).convert("RGB")) for p in calibration_images])
    fc = model.fc
    model.fc = torch.nn.Identity()
    with torch.inference_mode():
        features = model(batch).double()
    model.fc = fc

    weight = fc.weight.detach().double()
    centre = _equidistant_point(features)
    scale = _scale_for_median_top1((features - centre) @ weight.T, target_top1)
    with torch.no_grad():
        fc.weight.copy_(scale * weight)
        fc.bias.copy_(-scale * (weight @ centre))
    return model.state_dict()


def _equidistant_point(points: torch.Tensor) -> torch.Tensor:
    """The point of the points' affine span at the same distance from each (circumcentre)."""
    origin, edges = points[0], points[1:] - points[0]
    gram = edges @ edges.T
    # |c - p_k|^2 = |c - p_0|^2 for c = p_0 + t @ edges  <=>  gram @ t = |edge_k|^2 / 2
    coefficients = torch.linalg.lstsq(gram, gram.diagonal() / 2).solution
    return origin + coefficients @ edges


def _scale_for_median_top1(logits: torch.Tensor, target: float) -> float:
    """The factor that makes the median top-1 softmax probability of ``logits`` ``target``."""

    def median_top1(scale: float) -> float:
        return float((logits * scale).softmax(dim=1).max(dim=1).values.median())

    low, high = 1e-3, 1e4  # bisection in log space; top-1 grows with the scale
    for _ in range(60):
        middle = (low * high) ** 0.5
        if median_top1(middle) < target:
            low = middle
        else:
            high = middle
    return (low * high) ** 0.5


def converted_weights(path: Path) -> dict[str, torch.Tensor]:
    """A torchvision resnet152 state dict, checked to fit ResNet152ImageClassifier."""
    state_dict = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state_dict, Mapping):
        raise SystemExit(f"{path} holds a {type(state_dict).__name__}, not a state dict")
    model = ResNet152ImageClassifier()
    model.load_state_dict(state_dict)  # raises, naming the keys, when it does not fit
    return model.state_dict()


def write_weights(
    output: Path = DEFAULT_OUTPUT, *, weights: Path | None = None, seed: int = 0
) -> Path:
    """Write the state dict to ``output`` (atomically) and return its path."""
    state_dict = converted_weights(weights) if weights is not None else random_weights(seed)
    output = Path(output)
    partial = output.with_name(f".{output.name}.partial")
    torch.save(state_dict, partial)
    os.replace(partial, output)
    return output


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--weights", type=Path, help="a real torchvision resnet152 state dict to convert"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where to write")
    args = parser.parse_args(argv)
    path = write_weights(args.output, weights=args.weights, seed=args.seed)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
