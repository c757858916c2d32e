"""``ts.metrics.metric_collector``: TorchServe's system metrics script
(``python -m ts.metrics.metric_collector --gpu N``, the pids of worker processes on stdin).

batchserve's frontend does not run it: it measures the host itself every
``metric_time_interval``. Run as a script, it prints TorchServe's lines.
"""

from __future__ import annotations

import argparse
import logging
import sys

from . import system_metrics
from .process_memory_metric import check_process_mem_usage

__all__ = ["argparse", "check_process_mem_usage", "logging", "sys", "system_metrics"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", action="store", help="number of GPUs", type=int, default=0)
    arguments = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stdout, format="%(message)s", level=logging.INFO)
    system_metrics.collect_all(system_metrics, arguments.gpu)
    check_process_mem_usage(sys.stdin)


if __name__ == "__main__":
    main()
