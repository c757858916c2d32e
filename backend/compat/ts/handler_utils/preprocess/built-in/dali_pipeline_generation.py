"""The default DALI pipeline of TorchServe's DALI handlers: JPEG bytes decoded on the GPU
("mixed"), resized so the short side is 256 (linear, antialiased), centre-cropped to 224 and
normalised with ImageNet's mean and standard deviation, as ``[3, 224, 224]`` float.

Needs NVIDIA DALI at import. Run as a script to serialize it:
``python dali_pipeline_generation.py --save ./default.dali``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from backend.optional import require

dali = require("nvidia.dali", "ts.handler_utils.preprocess.built-in.dali_pipeline_generation",
               "see NVIDIA DALI's installation guide")
types = require("nvidia.dali.types", "ts.handler_utils.preprocess.built-in")

_MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
_STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Serialize the default DALI pipeline")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--num_threads", type=int, default=1)
    parser.add_argument("--device_id", type=int, default=1)
    parser.add_argument("--save", default="./default.dali")
    return parser.parse_args()


@dali.pipeline_def  # type: ignore[misc]
def pipe() -> Any:
    """The graph: an external source named "source" of encoded images in, images out."""
    fn = dali.fn
    encoded = fn.external_source(dtype=types.UINT8, name="source")
    decoded = fn.decoders.image(encoded, device="mixed")
    resized = fn.resize(decoded, size=[256], subpixel_scale=False,
                        interp_type=types.DALIInterpType.INTERP_LINEAR, antialias=True,
                        mode="not_smaller")
    return fn.crop_mirror_normalize(resized, crop_pos_x=0.5, crop_pos_y=0.5, crop=(224, 224),
                                    mean=_MEAN, std=_STD)


def main(batch_size: int, num_threads: int, device_id: int, filename: str) -> None:
    """Serialize the pipeline, sized as given, to ``filename``."""
    pipeline = pipe(batch_size=batch_size, num_threads=num_threads, device_id=device_id)
    pipeline.serialize(filename=filename)
    print(f"Saved {filename}")


if __name__ == "__main__":
    args = parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.save)), exist_ok=True)
    main(args.batch_size, args.num_threads, args.device_id, args.save)
