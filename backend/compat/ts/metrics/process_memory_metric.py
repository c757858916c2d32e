"""``ts.metrics.process_memory_metric``: the memory of worker processes, by pid.

TorchServe's frontend writes its workers' pids to the collector script's stdin and reads
``pid:bytes`` lines back; batchserve's frontend reads its workers itself. These functions work
as TorchServe's for scripts that call them.
"""

from __future__ import annotations

import logging
from typing import TextIO

import psutil

__all__ = ["check_process_mem_usage", "get_cpu_usage", "logging", "psutil"]


def get_cpu_usage(pid: str | int) -> int:
    """The resident memory of process ``pid`` in bytes (0 when there is no such process).
    (TorchServe's name for it.)"""
    try:
        process = psutil.Process(int(pid))
    except psutil.Error:
        logging.error("Failed get process for pid: %s", pid, exc_info=True)
        return 0
    return int(process.memory_info()[0])


def check_process_mem_usage(stdin: TextIO) -> None:
    """Log ``pid:bytes`` for each pid of the comma-separated line read from ``stdin``."""
    for process in stdin.readline().strip().split(","):
        if process:
            logging.info("%s:%d", process, get_cpu_usage(process))
