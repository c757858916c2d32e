"""GPU discovery (without initialising CUDA in the frontend) and round-robin assignment."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

_DEVICE = re.compile(r"^nvidia\d+$")


def visible_gpu_count(dev: Path = Path("/dev")) -> int:
    """Count NVIDIA GPU device nodes; reading /dev never initialises CUDA."""
    try:
        return sum(1 for entry in dev.iterdir() if _DEVICE.match(entry.name))
    except OSError:
        return 0


class GpuAssigner:
    """Hands out GPU ids round robin across every worker of every model, as TorchServe does."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._next = itertools.count()

    @classmethod
    def detect(cls, number_of_gpu: int | None) -> GpuAssigner:
        visible = visible_gpu_count()
        return cls(visible if number_of_gpu is None else min(number_of_gpu, visible))

    def next(self) -> int | None:
        if self.count == 0:
            return None
        return next(self._next) % self.count
