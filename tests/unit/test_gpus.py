"""GPU assignment with a simulated GPU count (no GPU is needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from frontend.serving.placement import GpuAssigner, visible_gpu_count


def test_round_robin_over_every_gpu() -> None:
    gpus = GpuAssigner(3)
    assert [gpus.next() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_device_ids_restrict_the_set() -> None:
    gpus = GpuAssigner(4)
    assert [gpus.next((1, 3)) for _ in range(4)] == [1, 3, 1, 3]
    with pytest.raises(ValueError, match="deviceIds"):
        gpus.next((7,))


def test_no_gpu_means_cpu() -> None:
    assert GpuAssigner(0).next() is None
    assert GpuAssigner(0).next((0, 1)) is None


def test_visible_gpu_count_reads_device_nodes(tmp_path: Path) -> None:
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "null"):
        (tmp_path / name).touch()
    assert visible_gpu_count(tmp_path) == 2
    assert visible_gpu_count(tmp_path / "absent") == 0


def test_number_of_gpu_caps_the_visible_count() -> None:
    assert GpuAssigner.detect(0).count == 0
