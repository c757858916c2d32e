"""``ts.metrics.system_metrics``: the host's metrics as TorchServe's collector script gathers
them (CPU, memory, disk, and GPUs through torch).

batchserve's frontend measures the same metrics itself, every ``metric_time_interval``, and
exports them as TorchServe's frontend does; this module is for scripts written against
TorchServe's: each function appends a ``Metric`` to ``system_metrics``, and ``collect_all``
logs them as TorchServe's ``[name].[unit]:[value]|#[dimensions]|#hostname:..`` lines.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import psutil

from backend.metrics.dimension import Dimension
from backend.metrics.legacy import Metric

__all__ = [
    "Dimension",
    "Metric",
    "collect_all",
    "cpu_utilization",
    "dimension",
    "disk_available",
    "disk_used",
    "disk_utilization",
    "gpu_utilization",
    "logging",
    "memory_available",
    "memory_used",
    "memory_utilization",
    "psutil",
    "system_metrics",
    "types",
]

system_metrics: list[Metric] = []
dimension = [Dimension("Level", "Host")]


def __getattr__(name: str) -> Any:
    """``torch``, as TorchServe's module has it, imported when first asked for."""
    if name == "torch":
        import torch

        return torch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cpu_utilization() -> None:
    system_metrics.append(Metric("CPUUtilization", psutil.cpu_percent(), "percent", dimension))


def memory_used() -> None:
    data = psutil.virtual_memory().used / (1024 * 1024)
    system_metrics.append(Metric("MemoryUsed", data, "MB", dimension))


def memory_available() -> None:
    data = psutil.virtual_memory().available / (1024 * 1024)
    system_metrics.append(Metric("MemoryAvailable", data, "MB", dimension))


def memory_utilization() -> None:
    data = psutil.virtual_memory().percent
    system_metrics.append(Metric("MemoryUtilization", data, "percent", dimension))


def disk_used() -> None:
    data = psutil.disk_usage("/").used / (1024 * 1024 * 1024)
    system_metrics.append(Metric("DiskUsage", data, "GB", dimension))


def disk_utilization() -> None:
    data = psutil.disk_usage("/").percent
    system_metrics.append(Metric("DiskUtilization", data, "percent", dimension))


def disk_available() -> None:
    data = psutil.disk_usage("/").free / (1024 * 1024 * 1024)
    system_metrics.append(Metric("DiskAvailable", data, "GB", dimension))


def gpu_utilization(num_of_gpu: int) -> None:
    """GPU memory used (MB), memory utilisation and GPU utilisation (percent) of the first
    ``num_of_gpu`` CUDA devices (nothing without CUDA)."""
    if num_of_gpu <= 0:
        return
    import torch

    if not torch.cuda.is_available():
        return
    for gpu_index in range(num_of_gpu):
        free, total = torch.cuda.mem_get_info(gpu_index)
        mem_used = (total - free) // 1024**2
        try:
            gpu_mem_utilization: Any = torch.cuda.memory_usage(gpu_index)
            gpu_utilization: Any = torch.cuda.utilization(gpu_index)
        except Exception:  # torch reads these through nvidia-ml-py, which may be missing
            logging.error("Could not read the utilisation of GPU %d", gpu_index, exc_info=True)
            gpu_mem_utilization = gpu_utilization = None
        dimension_gpu = [Dimension("Level", "Host"), Dimension("device_id", gpu_index)]
        system_metrics.append(
            Metric("GPUMemoryUtilization", gpu_mem_utilization, "percent", dimension_gpu))
        system_metrics.append(Metric("GPUMemoryUsed", mem_used, "MB", dimension_gpu))
        system_metrics.append(Metric("GPUUtilization", gpu_utilization, "percent", dimension_gpu))


def collect_all(mod: types.ModuleType, num_of_gpu: int) -> None:
    """Run every collecting function of ``mod`` and log what they gathered, a line each,
    then an empty line."""
    for name in dir(mod):
        value = getattr(mod, name)
        if isinstance(value, types.FunctionType) and value.__name__ not in (
                "collect_all", "__getattr__"):
            if value.__name__ == "gpu_utilization":
                value(num_of_gpu)
            else:
                value()
    for met in system_metrics:
        logging.info(str(met))
    logging.info("")
