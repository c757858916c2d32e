"""``ts.torch_handler.unit_tests.test_utils.model_dir``: fetching and copying test models.

``download_model`` keeps what it fetched in ``REPO_DIR/.cache``; TorchServe's ``REPO_DIR``
is its source tree, batchserve's the working directory the tests run from.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from urllib import request
from urllib.parse import urlparse

REPO_DIR = Path.cwd()


def download_model(model_url: str, model_dir: Path) -> None:
    """``model_url``'s file (fetched once into the cache) copied to ``model_dir/model.pt``."""
    cache = REPO_DIR / ".cache"
    cache.mkdir(exist_ok=True)
    cached = cache / Path(urlparse(model_url).path).name
    if not cached.exists():
        with request.urlopen(model_url) as source, open(cached, "wb") as target:
            shutil.copyfileobj(source, target)
    shutil.copy(cached, Path(model_dir) / "model.pt")


def copy_files(src_dir: Path, dst_dir: Path, files: dict[str, str]) -> None:
    """Copy each ``{source name: destination name}`` from ``src_dir`` to ``dst_dir``."""
    for source, destination in files.items():
        shutil.copyfile(Path(src_dir) / source, Path(dst_dir) / destination)
