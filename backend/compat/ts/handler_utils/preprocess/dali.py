"""``ts.handler_utils.preprocess.dali``: the DALI pipeline a DALI handler preprocesses with.

Needs NVIDIA DALI (``nvidia.dali``) at import, as TorchServe's module does. The ``dali``
section of model-config.yaml sets ``batch_size``, ``num_threads``, ``device_id``, ``seed``
and optionally ``pipeline_file`` (a serialized pipeline in the archive). Without a
``pipeline_file`` TorchServe deserializes the ``default.dali`` file it ships; batchserve
builds that same default pipeline (decode, resize 256, centre crop 224, ImageNet
normalisation) in code instead (``built-in/dali_pipeline_generation.py``).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from backend.optional import require

_pipeline = require("nvidia.dali.pipeline", "ts.handler_utils.preprocess.dali",
                    "see NVIDIA DALI's installation guide")

#: Where the default pipeline is defined, relative to this package (the folder's name is not
#: an identifier, so it is imported by name).
DEFAULT_PIPELINE_MODULE = ".built-in.dali_pipeline_generation"


def get_dali_pipeline(ctx: Any) -> Any:
    """The pipeline model-config.yaml's ``dali`` section describes, sized for its batch."""
    section = ctx.model_yaml_config.get("dali")
    if not isinstance(section, dict):
        raise ValueError(f"{ctx.model_name} has no dali config in model config yaml file")
    batch_size, num_threads = section["batch_size"], section["num_threads"]
    device_id, seed = section["device_id"], section["seed"]
    if "pipeline_file" in section:
        path = os.path.join(str(ctx.system_properties.get("model_dir")), section["pipeline_file"])
        if not os.path.exists(path):
            raise RuntimeError(f"Missing dali pipeline file {path}.")
        pipeline = _pipeline.Pipeline.deserialize(
            filename=path, batch_size=batch_size, num_threads=num_threads,
            prefetch_queue_depth=1, device_id=device_id, seed=seed)
    else:
        generation = importlib.import_module(DEFAULT_PIPELINE_MODULE, __package__)
        pipeline = generation.pipe(batch_size=batch_size, num_threads=num_threads,
                                   device_id=device_id, seed=seed, prefetch_queue_depth=1)
        pipeline.build()
    # As TorchServe does: a deserialized pipeline keeps the sizes it was saved with otherwise.
    pipeline._max_batch_size = batch_size
    pipeline._num_threads = num_threads
    pipeline._device_id = device_id
    return pipeline
