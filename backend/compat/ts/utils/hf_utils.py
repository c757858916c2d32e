"""``ts.utils.hf_utils``: a model's checkpoint files from the Hugging Face Hub.

Needs ``huggingface_hub`` at import, as TorchServe's module does.
"""

from __future__ import annotations

from typing import Any

from backend.optional import require

_hub = require("huggingface_hub", "ts.utils.hf_utils")

#: Only these files are fetched: configs, tokenizers and PyTorch/safetensors weights.
CHECKPOINT_PATTERNS = ["*.json", "*.pt", "*.bin", "*.txt", "*.model", "*.pth",
                       "*.safetensors", "original/*"]


def download_model(model_id: str = "meta-llama/Meta-Llama-3.1-8B-Instruct",
                   revision: str = "main", model_path: str = ".cache",
                   use_auth_token: Any = True) -> str:
    """Download ``model_id`` at ``revision`` into the cache folder ``model_path``; returns
    the snapshot's folder."""
    path: str = _hub.snapshot_download(
        repo_id=model_id, revision=revision, allow_patterns=CHECKPOINT_PATTERNS,
        cache_dir=model_path, token=use_auth_token)
    return path
