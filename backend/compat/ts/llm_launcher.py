"""``ts.llm_launcher``: serve a Hugging Face LLM in one command
(``python -m ts.llm_launcher --model_id ... --engine vllm|trt_llm``).

It writes a model-config.yaml for the engine's handler (``vllm_handler`` or
``trt_llm_handler``), makes a no-archive model folder (with batchserve's model archiver, as
TorchServe's uses its own), builds the TensorRT-LLM engine when asked, and serves it with
``torchserve`` until interrupted. Needs ``huggingface_hub`` at import (through
``ts.utils.hf_utils``), as TorchServe's module does, and the engine's package to serve.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from signal import pause
from typing import Any

import yaml

from model_archiver.packaging import ArchiveFormat, ArchiveOptions, build_archive

from .launcher import start, stop
from .utils.hf_utils import download_model

__all__ = ["create_mar_file", "create_tensorrt_llm_engine", "download_model",
           "get_model_config", "main", "start", "stop"]

#: TensorRT-LLM's sources (for its checkpoint converter), as TorchServe 0.12 uses them.
TRT_LLM_REPO = "https://github.com/NVIDIA/TensorRT-LLM.git"
TRT_LLM_TAG = "v0.12.0"
TRT_LLM_DIR = Path("/tmp/TensorRT-LLM")


def create_tensorrt_llm_engine(model_store: str, model_name: str, dtype: str,
                               snapshot_path: str, max_batch_size: int) -> None:
    """Convert the snapshot to a TensorRT-LLM checkpoint and build its engine under
    ``model_store/model_name`` (each step skipped when its output exists)."""
    folder = Path(model_store) / model_name
    checkpoint = folder / "tllm_checkpoint_1gpu_bf16"
    engine = folder / f"{model_name}-engine"
    if not TRT_LLM_DIR.exists():
        subprocess.run(["git", "clone", TRT_LLM_REPO, "-b", TRT_LLM_TAG, str(TRT_LLM_DIR)],
                       check=True)
    if not checkpoint.exists():
        subprocess.run(["python", str(TRT_LLM_DIR / "examples/llama/convert_checkpoint.py"),
                        "--model_dir", snapshot_path, "--output_dir", str(checkpoint),
                        "--dtype", dtype], check=True)
    if not engine.exists():
        subprocess.run(["trtllm-build", "--checkpoint_dir", str(checkpoint), "--gemm_plugin",
                        dtype, "--gpt_attention_plugin", dtype, "--max_batch_size",
                        str(max_batch_size), "--output_dir", str(engine)], check=True)


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def get_model_config(args: Any, model_snapshot_path: str | None = None) -> dict[str, Any]:
    """The model-config.yaml for the engine ``args.engine`` names."""
    config: dict[str, Any] = {
        "minWorkers": 1, "maxWorkers": 1, "batchSize": 1, "maxBatchDelay": 100,
        "responseTimeout": 1200, "startupTimeout": args.startup_timeout,
        "deviceType": "gpu", "asyncCommunication": True,
    }
    if args.engine == "vllm":
        download_dir = getattr(args, "vllm_engine.download_dir")
        config["parallelLevel"] = _gpus()
        config["handler"] = {
            "model_path": args.model_id,
            "vllm_engine_config": {
                "max_num_seqs": getattr(args, "vllm_engine.max_num_seqs"),
                "max_model_len": getattr(args, "vllm_engine.max_model_len"),
                "download_dir": Path(download_dir).resolve().as_posix() if download_dir
                else download_dir,
                "tensor_parallel_size": _gpus(),
            },
        }
        if hasattr(args, "lora_adapter_ids"):
            raise NotImplementedError("Lora setting needs to be implemented")
    elif args.engine == "trt_llm":
        config["handler"] = {
            "tokenizer_dir": os.path.join(os.getcwd(), model_snapshot_path or ""),
            "engine_dir": f"{args.model_name}-engine",
            "kv_cache_config": {"free_gpu_memory_fraction": getattr(
                args, "trt_llm_engine.kv_cache_free_gpu_memory_fraction")},
        }
    else:
        raise RuntimeError(f"Unsupported LLM Engine {args.engine!r}: use vllm or trt_llm")
    return config


@contextlib.contextmanager
def create_mar_file(args: Any, model_snapshot_path: str | None = None) -> Iterator[str]:
    """A no-archive model folder ``model_store/model_name`` for the engine's handler, for
    as long as the context lasts (a vLLM folder is removed afterwards)."""
    store = Path(args.model_store)
    folder = store / args.model_name
    config_file = store / "model-config.yaml"
    config_file.write_text(yaml.safe_dump(get_model_config(args, model_snapshot_path)),
                           encoding="utf-8")
    try:
        if not folder.exists():
            build_archive(ArchiveOptions(
                model_name=args.model_name, version="1.0", handler=f"{args.engine}_handler",
                export_path=store, config_file=str(config_file),
                archive_format=ArchiveFormat.NO_ARCHIVE, force=True))
    finally:
        config_file.unlink()
    yield folder.as_posix()
    if args.engine == "vllm":
        shutil.rmtree(folder)


def main(args: Any) -> None:
    """Prepare the model, serve it until interrupted, then stop the server."""
    Path(args.model_store).mkdir(parents=True, exist_ok=True)
    snapshot = download_model(args.model_id) if args.engine == "trt_llm" else None
    with create_mar_file(args, snapshot):
        if args.engine == "trt_llm":
            assert snapshot is not None
            create_tensorrt_llm_engine(args.model_store, args.model_name, args.dtype, snapshot,
                                       getattr(args, "trt_llm_engine.max_batch_size"))
        try:
            start(model_store=args.model_store, no_config_snapshots=True,
                  models=args.model_name, disable_token=args.disable_token_auth)
            pause()
        except KeyboardInterrupt:
            pass
        finally:
            stop(wait=False)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Serve a Hugging Face LLM")
    parser.add_argument("--model_name", type=str, default="model", help="Model name")
    parser.add_argument("--model_store", type=str, default="model_store", help="Model store")
    parser.add_argument("--model_id", type=str, default="meta-llama/Meta-Llama-3.1-8B-Instruct",
                        help="Model id")
    parser.add_argument("--disable_token_auth", action="store_true",
                        help="Disable token authentication")
    parser.add_argument("--vllm_engine.max_num_seqs", type=int, default=256,
                        help="Max sequences in vllm engine")
    parser.add_argument("--vllm_engine.max_model_len", type=int, default=None,
                        help="Model context length")
    parser.add_argument("--vllm_engine.download_dir", type=str, default=None, help="Cache dir")
    parser.add_argument("--startup_timeout", type=int, default=1200,
                        help="Model startup timeout in seconds")
    parser.add_argument("--engine", type=str, default="vllm", help="LLM engine")
    parser.add_argument("--dtype", type=str, default="bfloat16", help="Data type")
    parser.add_argument("--trt_llm_engine.max_batch_size", type=int, default=4,
                        help="Max batch size")
    parser.add_argument("--trt_llm_engine.kv_cache_free_gpu_memory_fraction", type=float,
                        default=0.1, help="KV Cache free gpu memory fraction")
    return parser


if __name__ == "__main__":
    main(_parser().parse_args())
