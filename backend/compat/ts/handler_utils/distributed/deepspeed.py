"""``ts.handler_utils.distributed.deepspeed``: a DeepSpeed inference engine for a handler's
model, configured by the ``deepspeed`` section of model-config.yaml.

Needs ``deepspeed`` at import, as TorchServe's module does. The worker's ranks are
torchrun's (``LOCAL_RANK``, ``WORLD_SIZE``); batchserve starts one process per worker, so
a model that needs several ranks must start them itself (see the report of ``parallelType``
in the model log).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from backend.optional import require

from ...context import Context

_deepspeed = require("deepspeed", "ts.handler_utils.distributed.deepspeed")

logger = logging.getLogger(__name__)


def create_checkpoints_json(model_path: str, checkpoints_json: str) -> None:
    """Write DeepSpeed's checkpoint list: every ``.bin`` and ``.pt`` file under
    ``model_path``."""
    files = sorted(str(path) for path in Path(model_path).rglob("*")
                   if path.is_file() and path.suffix in (".bin", ".pt"))
    logger.info("Creating deepspeed checkpoint file %s", checkpoints_json)
    with open(checkpoints_json, "w", encoding="utf-8") as file:
        json.dump({"type": "ds_model", "checkpoints": files, "version": 1.0}, file)


def get_ds_engine(model: Any, ctx: Context) -> Any:
    """``deepspeed.init_inference`` of ``model`` with the config file and checkpoint that
    model-config.yaml's ``deepspeed`` section names (relative to the model directory), and
    ``handler.model_path`` as the checkpoints' folder."""
    config = ctx.model_yaml_config
    section = config.get("deepspeed")
    if not isinstance(section, dict):
        raise ValueError(f"{ctx.model_name} has no deepspeed config in model config yaml file")
    model_dir = str(ctx.system_properties.get("model_dir"))
    model_path = config["handler"]["model_path"]
    ds_config = checkpoint = None
    if "config" in section:
        ds_config = os.path.join(model_dir, section["config"])
        if not os.path.exists(ds_config):
            raise ValueError(f"{ctx.model_name} has no deepspeed config file {ds_config}")
    if "checkpoint" in section:
        checkpoint = os.path.join(model_dir, section["checkpoint"])
        create_checkpoints_json(model_path, checkpoint)
    logger.debug("Creating DeepSpeed engine")
    return _deepspeed.init_inference(model, config=ds_config, base_dir=model_path,
                                     checkpoint=checkpoint)
