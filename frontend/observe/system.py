"""The host's metrics, as TorchServe's collector script measures them (``ts/metrics/
system_metrics.py``): CPU, memory and the root file system, and per GPU its utilisation,
memory utilisation and memory used.

TorchServe runs that script every ``metric_time_interval`` seconds (60) and keeps the values
until the next run; so does the server (``ServerMetrics.run_system_metrics``), measuring in a
thread, off the event loop. GPUs are read with nvidia-ml-py (what ``torch.cuda.utilization``
itself uses), or ``nvidia-smi`` where it is not installed; with neither, or no GPU, there are
no GPU values, and nothing fails.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Sequence

import psutil

logger = logging.getLogger(__name__)

#: (metric name, dimension values before the host name, value)
Reading = tuple[str, tuple[str, ...], float]
_HOST = ("Host",)
_MiB = 1024 * 1024
_GiB = 1024 * 1024 * 1024


class SystemSampler:
    """Measures the host; CPU utilisation is the average since the previous reading."""

    def __init__(self, gpu_count: int = 0) -> None:
        self.gpu_count = gpu_count
        self._gpu_failed = False
        psutil.cpu_percent(interval=None)  # starts the measurement the first reading ends

    def read(self) -> list[Reading]:
        """One reading of every system metric (blocking: call it in a thread)."""
        memory = psutil.virtual_memory()
        disk = psutil.disk_usage("/")
        readings: list[Reading] = [
            ("CPUUtilization", _HOST, psutil.cpu_percent(interval=None)),
            ("MemoryUsed", _HOST, memory.used / _MiB),
            ("MemoryAvailable", _HOST, memory.available / _MiB),
            ("MemoryUtilization", _HOST, memory.percent),
            ("DiskUsage", _HOST, disk.used / _GiB),
            ("DiskUtilization", _HOST, disk.percent),
            ("DiskAvailable", _HOST, disk.free / _GiB),
        ]
        if self.gpu_count > 0 and not self._gpu_failed:
            try:
                readings.extend(self._gpus())
            except Exception as exc:  # a driver that went away: say it once, then stop asking
                self._gpu_failed = True
                logger.warning("GPU metrics are not available: %s", exc)
        return readings

    def _gpus(self) -> list[Reading]:
        return read_gpus(self.gpu_count)


def read_gpus(gpu_count: int) -> list[Reading]:
    """The first ``gpu_count`` GPUs' utilisation, memory utilisation and memory used
    (blocking; raises when they cannot be read). The live page reads them too."""
    devices = _physical_devices(gpu_count)
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return _nvidia_smi(devices)
    pynvml.nvmlInit()
    try:
        readings: list[Reading] = []
        for index, device in enumerate(devices):
            handle = pynvml.nvmlDeviceGetHandleByIndex(device)
            rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            readings.extend(_gpu_readings(index, float(rates.memory),
                                          float(int(memory.used) // _MiB), float(rates.gpu)))
        return readings
    finally:
        pynvml.nvmlShutdown()


def _gpu_readings(index: int, memory_utilization: float, memory_used_mb: float,
                  utilization: float) -> list[Reading]:
    """A GPU's three metrics, labelled as TorchServe labels them (``DeviceId``: its index)."""
    labels = ("Host", str(index))
    return [("GPUMemoryUtilization", labels, memory_utilization),
            ("GPUMemoryUsed", labels, memory_used_mb),
            ("GPUUtilization", labels, utilization)]


def _physical_devices(count: int) -> list[int]:
    """The NVML indices of CUDA devices 0..count-1 (``CUDA_VISIBLE_DEVICES`` renumbers
    them for the workers, not for NVML)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        parts = [part.strip() for part in visible.split(",")]
        if all(part.isdigit() for part in parts):
            return [int(part) for part in parts][:count]
    return list(range(count))


def parse_nvidia_smi(text: str, devices: Sequence[int]) -> list[Reading]:
    """Readings from ``nvidia-smi --query-gpu=index,utilization.gpu,utilization.memory,
    memory.used --format=csv,noheader,nounits`` output (values it cannot tell, ``[N/A]``,
    are left out)."""
    rows: dict[int, list[str]] = {}
    for line in text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 4 and fields[0].isdigit():
            rows[int(fields[0])] = fields[1:]
    readings: list[Reading] = []
    for index, device in enumerate(devices):
        row = rows.get(device)
        if row is None:
            continue
        labels = ("Host", str(index))
        for name, text_value in zip(("GPUUtilization", "GPUMemoryUtilization", "GPUMemoryUsed"),
                                    row, strict=True):
            try:
                readings.append((name, labels, float(text_value)))
            except ValueError:
                continue
    return readings


def _nvidia_smi(devices: Sequence[int]) -> list[Reading]:
    command = shutil.which("nvidia-smi")
    if command is None:
        raise RuntimeError("neither nvidia-ml-py nor nvidia-smi is installed")
    output = subprocess.run(
        [command, "--query-gpu=index,utilization.gpu,utilization.memory,memory.used",
         "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10,
        check=True).stdout
    return parse_nvidia_smi(output, devices)
