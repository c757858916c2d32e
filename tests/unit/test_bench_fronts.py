"""The frontend-processes benchmark's pieces (benchmarks/fronts.py), in process: the JPEGs it
uploads, the CPU accounting over a process tree, and the report's medians and ratios."""

from __future__ import annotations

import io
import subprocess
import sys

from PIL import Image

from benchmarks.fronts import JPEG_BYTES, Config, Sample, make_jpegs, report, tree_cpu_s
from benchmarks.management import ManagementClient


def test_the_uploads_are_distinct_real_jpegs_of_about_64_kib_the_same_every_time() -> None:
    jpegs = make_jpegs(3, seed=7)
    assert jpegs == make_jpegs(3, seed=7)
    assert len(set(jpegs)) == 3
    for data in jpegs:
        assert abs(len(data) - JPEG_BYTES) < 0.05 * JPEG_BYTES
        assert data[:2] == b"\xff\xd8" and data[-2:] == b"\xff\xd9"
        with Image.open(io.BytesIO(data)) as image:
            assert image.format == "JPEG" and image.size == (448, 336)
            image.load()  # decodes whole: not truncated


BURN = ("import time\nstart = time.process_time()\n"
        "while time.process_time() - start < 0.3: pass\nprint('burnt', flush=True)\n")
TREE = f"""import subprocess, sys
burn = {BURN!r}
subprocess.run([sys.executable, "-c", burn], check=True)  # exits, waited for
alive = subprocess.Popen([sys.executable, "-c", burn + "import sys; sys.stdin.read()"],
                         stdin=subprocess.PIPE)
sys.stdin.read()
alive.stdin.close()
alive.wait()
"""


def test_tree_cpu_counts_live_descendants_and_children_that_exited() -> None:
    """0.3 s burnt by a child that exited and 0.3 s by a live grandchild-level process: a count
    of the root alone, or of the live processes alone, stays near 0.3 s."""
    tree = subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert tree.stdout is not None
        assert [tree.stdout.readline() for _ in range(2)] == ["burnt\n", "burnt\n"]
        assert 0.55 < tree_cpu_s(tree.pid) < 5
    finally:
        tree.communicate("", timeout=30)
    assert tree.returncode == 0


def test_a_sample_gives_cpu_per_1000_requests_and_requests_per_cpu_second() -> None:
    sample = Sample(rate=200, p50_ms=1, p99_ms=2, errors=0, requests=2000, wall_s=10, cpu_s=5)
    assert sample.cpu_per_1000 == 2.5
    assert sample.per_core == 400  # 200 req/s for 0.5 CPU-second per second
    assert sample.cores == 0.5


def _config(name: str, fronts: int | None, rates: list[float], cpu_s: float) -> Config:
    config = Config(name, ManagementClient(), fronts)
    for load in config.samples:
        config.samples[load] = [Sample(rate, 1, 3, 0, int(rate * 10), 10, cpu_s)
                                for rate in rates]
    return config


def test_the_report_gives_medians_and_ratios_to_torchserve_and_to_one_front() -> None:
    configs = [_config("batchserve N=1", 1, [1000, 900, 5000], 4.0),
               _config("batchserve N=2", 2, [1800, 2000, 1900], 5.7),
               _config("TorchServe 0.12", None, [500, 450, 480], 6.0)]
    text = report(configs, "header")
    assert text.startswith("header\n")
    # N=2: median 1,900 req/s = 3.96x TorchServe's 480 and 1.90x N=1's 1,000; its CPU per
    # 1000 requests (5.7 s over 19,000) 0.300 s = 0.24x TorchServe's (6 / 4,800 = 1.25 s) and
    # 0.75x N=1's (4 / 10,000 = 0.4 s).
    assert text.count("| batchserve N=2 | 1,900 | 3.96x | 1.90x | 1.00 | 3.00 | 0.300 | 0.24x "
                      "| 0.75x | 3,333 | 0.57 | 0 |") == 2  # echo and upload
    assert "| TorchServe 0.12 | 480 | 1.00x | 0.48x |" in text
    assert "batchserve N=1 echo: 1,000, 900, 5,000" in text
