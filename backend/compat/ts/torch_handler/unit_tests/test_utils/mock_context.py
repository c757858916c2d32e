"""``ts.torch_handler.unit_tests.test_utils.mock_context``: a context for testing a handler's
``initialize`` and ``handle`` without a server, as TorchServe's handler tests (and its
examples' tests) make it.

Its ``metrics`` are TorchServe's MetricsStore (``add_time``, ``add_counter``, ...), as in
TorchServe.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch

from backend.metrics.legacy import MetricsStore

from ....utils.util import get_yaml_config

__all__ = ["MockContext", "get_yaml_config"]


def _metrics(model_name: str) -> MetricsStore:
    return MetricsStore(uuid.uuid4(), model_name)


class MockContext:
    """The manifest (``serializedFile``, ``modelFile``), ``system_properties`` (``model_dir``,
    and ``gpu_id`` when CUDA is there), ``metrics``, ``model_yaml_config`` (read from
    ``model_yaml_config_file`` in ``model_dir``) and ``explain``."""

    def __init__(self, model_pt_file: str | None = "model.pt",
                 model_dir: str = "ts/torch_handler/unit_tests/models/tmp",
                 model_file: str | None = "model.py", gpu_id: str | None = "0",
                 model_name: str = "mnist", model_yaml_config_file: str | None = None) -> None:
        self.manifest: dict[str, Any] = {"model": {}}
        if model_pt_file:
            self.manifest["model"]["serializedFile"] = model_pt_file
        if model_file:
            self.manifest["model"]["modelFile"] = model_file
        self.system_properties: dict[str, Any] = {"model_dir": model_dir}
        if torch.cuda.is_available() and gpu_id:
            self.system_properties["gpu_id"] = gpu_id
        self.explain = False
        self.metrics = _metrics(model_name)
        self.model_yaml_config: dict[str, Any] = {}
        if model_yaml_config_file:
            self.model_yaml_config = get_yaml_config(
                os.path.join(model_dir, model_yaml_config_file))

    def get_request_header(self, idx: int, exp: str) -> bool:
        """True for a request index and name when ``explain`` is set (TorchServe's mock)."""
        return bool(idx and exp and self.explain)
