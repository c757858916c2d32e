"""``ts.handler_utils.distributed.pt_pippy``: PiPPy pipeline parallelism for a handler's
model: RPC workers per rank, and the model split into ``WORLD_SIZE`` stages, configured by
the ``pippy`` and ``handler`` sections of model-config.yaml.

Needs ``pippy`` at import, as TorchServe's module does.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

import torch
import torch.distributed.rpc as rpc

from backend.optional import require

_pippy = require("pippy", "ts.handler_utils.distributed.pt_pippy")
pippy_installed = True

logger = logging.getLogger(__name__)


def initialize_rpc_workers(local_rank: int, world_size: int, ctx: Any) -> None:
    """Start this rank's RPC worker (``worker<rank>``), each rank's tensors mapped to its
    GPU; ``pippy.rpc_timeout`` and ``pippy.num_worker_threads`` come from model-config.yaml."""
    section = ctx.model_yaml_config["pippy"]
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=section["num_worker_threads"], rpc_timeout=section["rpc_timeout"])
    devices = torch.cuda.device_count()
    device = local_rank % devices
    for rank in range(world_size):
        options.set_device_map(f"worker{rank}", {device: rank % devices})
    logger.info("rank = %d pid/device = %d/%d", local_rank, os.getpid(), device)
    rpc.init_rpc(f"worker{local_rank}", rank=local_rank,  # type: ignore[no-untyped-call]
                 world_size=world_size, rpc_backend_options=options)


def get_pipeline_driver(model: Any, world_size: int, ctx: Any) -> Any:
    """``model`` compiled by PiPPy into ``world_size`` equal stages: for ``pippy.model_type``
    "HF" the model itself with the pipeline's forward injected, else the pipeline driver.

    model-config.yaml: ``pippy.input_names``, ``pippy.model_type``, ``pippy.chunks`` (1),
    ``handler.model_path`` and ``handler.index_filename`` (optional, under model_path).
    """
    config = ctx.model_yaml_config
    for section, key in (("pippy", None), ("handler", None), ("pippy", "input_names"),
                         ("pippy", "model_type"), ("handler", "model_path")):
        if section not in config or (key is not None and key not in config[section]):
            raise ValueError(f"Missing '{key or section}' key in YAML config"
                             + (f" section {section!r}" if key else ""))
    pippy, handler = config["pippy"], config["handler"]
    input_names = pippy["input_names"]
    model_type = pippy["model_type"]
    index_file = handler.get("index_filename")
    index_path = None
    if index_file is not None:
        index_path = os.path.join(handler["model_path"], index_file)
        if not os.path.exists(index_path):
            raise FileNotFoundError(f"Index file '{index_path}' not found")
    model.eval()
    concrete_args = {name: param.default
                     for name, param in inspect.signature(model.forward).parameters.items()
                     if name not in input_names}
    hf = model_type == "HF"
    if hf and "bloom" in str(model.__class__):
        concrete_args.setdefault("deprecated_arguments", {})
    logger.info("Initializing the model pipeline")
    pippy_hf = require("pippy.hf", "ts.handler_utils.distributed.pt_pippy") if hf else None
    driver, _ = _pippy.all_compile(
        model, num_ranks=world_size, num_chunks=pippy.get("chunks", 1), schedule="FillDrain",
        split_policy=_pippy.split_into_equal_size(world_size),
        tracer=pippy_hf.PiPPyHFTracer() if pippy_hf else None, concrete_args=concrete_args,
        index_filename=index_path, checkpoint_prefix=None)
    if pippy_hf is not None:
        pippy_hf.inject_pipeline_forward(model, driver)
        return model
    return driver
