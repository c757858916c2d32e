"""``ts.torch_handler.distributed.base_pippy_handler``: TorchServe's base of PiPPy handlers:
``initialize`` starts this rank's RPC worker. Needs ``pippy`` at import (through
``ts.handler_utils.distributed.pt_pippy``), as TorchServe's module does, and torchrun's
``LOCAL_RANK`` and ``WORLD_SIZE`` in the environment."""

from __future__ import annotations

import os
from typing import Any

import torch

from ...handler_utils.distributed.pt_pippy import initialize_rpc_workers
from ..base_handler import BaseHandler

__all__ = ["BaseHandler", "BasePippyHandler", "initialize_rpc_workers"]


class BasePippyHandler(BaseHandler):
    """Sets ``local_rank``, ``world_size`` and ``device`` (this rank's GPU index) and joins
    the RPC group."""

    def initialize(self, ctx: Any) -> None:
        for variable in ("LOCAL_RANK", "WORLD_SIZE"):
            if variable not in os.environ:
                raise RuntimeError(f"{type(self).__name__} needs torchrun's {variable} in the "
                                   f"environment; batchserve starts one process per worker "
                                   f"and no torchrun")
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.device = self.local_rank % torch.cuda.device_count()
        initialize_rpc_workers(self.local_rank, self.world_size, ctx)
