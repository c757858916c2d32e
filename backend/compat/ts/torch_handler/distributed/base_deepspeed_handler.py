"""``ts.torch_handler.distributed.base_deepspeed_handler``: TorchServe's base of DeepSpeed
handlers: ``initialize`` only takes this rank's GPU (``LOCAL_RANK``) as ``self.device``; the
subclass builds the engine (``ts.handler_utils.distributed.deepspeed.get_ds_engine``).

batchserve starts one process per worker and no torchrun: ``LOCAL_RANK`` is 0 unless the
environment sets it, so a model that needs several ranks must start them itself.
"""

from __future__ import annotations

import os

from ...context import Context
from ..base_handler import BaseHandler

__all__ = ["BaseDeepSpeedHandler", "BaseHandler", "Context"]


class BaseDeepSpeedHandler(BaseHandler):
    """Sets ``self.device`` to the local rank (an int, as DeepSpeed wants it)."""

    def initialize(self, ctx: Context) -> None:
        self.device = int(os.getenv("LOCAL_RANK", "0"))
