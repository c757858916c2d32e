"""ImageNet-sized JPEGs made here (no data set is downloaded): seeded, natural-ish pictures.

ImageNet's validation JPEGs are mostly 500x375 or 375x500 (some 500x333), encoded around
quality 90, 100-150 KB. These have those sizes and that weight: a smooth colour field with
a few soft-edged shapes (what a photograph's low frequencies look like), a coarse texture and
fine grain in luma and chroma (what makes a photograph's JPEG weigh what it does; pure noise
would weigh more, a flat picture far less). Every seed gives the same bytes.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

#: (width, height), cycled: landscape, portrait, and ImageNet's other common size.
IMAGENET_SIZES = ((500, 375), (375, 500), (500, 333))
QUALITY = 90
#: Standard deviations of the texture and grain (pixel values 0-255), found by trying: they
#: make 500x375 pictures of 110-120 KB at quality 90.
TEXTURE, GRAIN, CHROMA_GRAIN = 24.0, 14.0, 10.0


def natural_jpeg(width: int, height: int, seed: int, quality: int = QUALITY) -> bytes:
    """One picture, JPEG-encoded by Pillow."""
    rng = np.random.default_rng(seed)
    field = (rng.random((3, 4, 3)) * 255).astype(np.uint8)
    canvas = Image.fromarray(field).resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(canvas)
    for _ in range(int(rng.integers(6, 14))):
        x, y = (int(v) for v in rng.integers(-width // 4, width, 2))
        w, h = (int(v) for v in rng.integers(max(1, width // 10), width // 2, 2))
        draw.ellipse([x, y, x + w, y + h], fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    pixels = np.asarray(canvas.filter(ImageFilter.GaussianBlur(2)), dtype=np.float32)
    coarse = rng.normal(0, TEXTURE, ((height + 1) // 2, (width + 1) // 2, 3))
    pixels += coarse.repeat(2, 0).repeat(2, 1)[:height, :width] * np.array([1.0, 0.5, 0.5])
    pixels += rng.normal(0, GRAIN, (height, width, 1))
    pixels += rng.normal(0, CHROMA_GRAIN, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, "JPEG",
                                                                   quality=quality)
    return buffer.getvalue()


def natural_jpegs(count: int = 48, sizes: tuple[tuple[int, int], ...] = IMAGENET_SIZES,
                  seed: int = 0, quality: int = QUALITY) -> list[bytes]:
    """``count`` pictures, their sizes cycling through ``sizes``."""
    return [natural_jpeg(*sizes[index % len(sizes)], seed=seed + index, quality=quality)
            for index in range(count)]
