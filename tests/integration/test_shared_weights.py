"""Three CPU workers of one model hold one copy of its weights (the file's pages), against
the real server: read from each worker's /proc/PID/smaps_rollup and /proc/PID/smaps, with a
worker of the same model that keeps its own copy (``share_weights: false``) beside them.
Their answers equal, bit for bit, those of the model loaded the old way (a fully initialised
module, the state dict copied in). The archive goes through TorchServe's ``ts`` BaseHandler
(``_load_pickled_model``), the path most archives take."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from model_archiver.packaging import ArchiveOptions, build_archive
from tests.conftest import RunningServer

LAYERS, WIDTH = 8, 1024  # 8 layers of 1024 x 2048 float32: 64 MiB of weights
MIB = 1 << 20

MODEL = f"""
import torch

class Wide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear({WIDTH}, 2 * {WIDTH}) for _ in range({LAYERS}))

    def forward(self, x):
        # Every layer reads the same input: all the weights are read, the output stays small.
        return torch.stack([layer(x)[:, :4] for layer in self.layers], dim=1).sum(dim=1)
"""

HANDLER = """
import json

import torch
from ts.torch_handler.base_handler import BaseHandler


class Wide(BaseHandler):
    def preprocess(self, data):
        rows = [json.loads(row.get("body") or row.get("data")) for row in data]
        return torch.tensor(rows, dtype=torch.float32)

    def postprocess(self, data):
        return data.tolist()
"""


def archive(folder: Path, store: Path, name: str, weights: Path, config: str) -> None:
    (folder / "model.py").write_text(MODEL)
    (folder / "handler.py").write_text(HANDLER)
    (folder / f"{name}.yaml").write_text(textwrap.dedent(config))
    build_archive(ArchiveOptions(
        model_name=name, model_file=str(folder / "model.py"), serialized_file=str(weights),
        handler=str(folder / "handler.py"), config_file=str(folder / f"{name}.yaml"),
        export_path=store, archive_format="zip-store", force=True))


def rollup(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup in bytes."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text(errors="replace").splitlines()[1:]:
        key, value, *_ = line.split()
        fields[key.rstrip(":")] = int(value) * 1024
    return fields


def private(fields: dict[str, int]) -> int:
    return fields["Private_Clean"] + fields["Private_Dirty"]


def file_mapping(pid: int, name: str) -> dict[str, int]:
    """The Rss, Pss, Shared_Clean, ... of the mappings of a file named ``name`` in
    /proc/PID/smaps, summed, in bytes."""
    totals: dict[str, int] = {}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text(errors="replace").splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            inside = line.rstrip().endswith("/" + name)
        elif inside and head[0].endswith(":") and len(head) >= 3 and head[2] == "kB":
            key = head[0].rstrip(":")
            totals[key] = totals.get(key, 0) + int(head[1]) * 1024
    return totals


@pytest.fixture
def weights(tmp_path: Path) -> tuple[Path, Any]:
    """The weights file, and the model loaded from it the old way."""
    namespace: dict[str, Any] = {}
    exec(compile(MODEL, "model.py", "exec"), namespace)
    torch.manual_seed(11)
    path = tmp_path / "wide.pt"
    torch.save(namespace["Wide"]().state_dict(), path)
    old = namespace["Wide"]()
    old.load_state_dict(torch.load(path, weights_only=True))
    return path, old.eval()


def test_three_cpu_workers_share_one_copy_of_the_weights(
        tmp_path: Path, model_store: Path, weights: tuple[Path, Any],
        start_server: Callable[..., RunningServer]) -> None:
    path, old = weights
    size = path.stat().st_size
    archive(tmp_path, model_store, "wide", path, "minWorkers: 3\nmaxWorkers: 3\n")
    archive(tmp_path, model_store, "wide_copy", path, """
        minWorkers: 1
        maxWorkers: 1
        handler:
          share_weights: false
        """)
    server = start_server("wide.mar", "wide_copy.mar")
    server.wait_for(lambda: [w["status"] for w in server.describe("wide")["workers"]]  # type: ignore[attr-defined]
                    == ["READY"] * 3, "three READY workers", timeout_s=120)

    torch.manual_seed(12)
    row = torch.randn(1, WIDTH)
    with torch.inference_mode():
        expected = old(row)[0]
    body = json.dumps(row[0].tolist()).encode()
    # Enough requests that every worker answers some (and so reads every weight page). The
    # worker that loaded the old way (wide_copy) answers the same floats, bit for bit.
    for _ in range(12):
        answers = [server.predict(model, body) for model in ("wide", "wide_copy")]
        assert all(answer.status_code == 200 for answer in answers), answers[0].text
        assert answers[0].json() == answers[1].json()
        assert torch.allclose(torch.tensor(answers[0].json()), expected, rtol=0, atol=1e-5)

    shared = [int(w["pid"]) for w in server.describe("wide")["workers"]]  # type: ignore[attr-defined]
    (copy_pid,) = [int(w["pid"]) for w in server.describe("wide_copy")["workers"]]  # type: ignore[attr-defined]
    assert len(set(shared)) == 3

    # The weights file is mapped in each sharing worker, resident, never written by it (no
    # copy-on-write page: Private_Dirty 0) and shared three ways (Pss a third of Rss); the
    # copying worker does not map it. (The pages may count as Shared_Dirty until the kernel
    # has written the freshly extracted file back to disk: the page cache's state, not ours.)
    for pid in shared:
        mapping = file_mapping(pid, path.name)
        assert mapping.get("Rss", 0) >= 0.9 * size, (pid, mapping)
        assert mapping.get("Private_Dirty", 0) == 0, (pid, mapping)
        assert mapping["Pss"] <= 0.4 * mapping["Rss"], (pid, mapping)
    assert file_mapping(copy_pid, path.name).get("Rss", 0) == 0

    # From smaps_rollup: each sharing worker holds less private memory than the copying one
    # by most of the weights, and the three together count the weights about once.
    copying = rollup(copy_pid)
    sharing = [rollup(pid) for pid in shared]
    for fields in sharing:
        assert private(copying) - private(fields) >= 0.7 * size, (
            private(copying) // MIB, private(fields) // MIB)
    assert sum(f["Pss"] for f in sharing) <= 3 * copying["Pss"] - 2 * 0.7 * size, (
        [f["Pss"] // MIB for f in sharing], copying["Pss"] // MIB)


def test_share_weights_cuda_ipc_runs_through_the_server(
        tmp_path: Path, model_store: Path, weights: tuple[Path, Any],
        start_server: Callable[..., RunningServer]) -> None:
    # ``share_weights: cuda_ipc`` (issue 33, 4) served by the real server: on the CPU its
    # workers share the file's pages as ``true`` does, and both answer as the model does.
    path, old = weights
    archive(tmp_path, model_store, "wide_ipc", path, """
        minWorkers: 2
        maxWorkers: 2
        handler:
          share_weights: cuda_ipc
        """)
    server = start_server("wide_ipc.mar")
    server.wait_for(lambda: [w["status"] for w in server.describe("wide_ipc")["workers"]]  # type: ignore[attr-defined]
                    == ["READY"] * 2, "two READY workers", timeout_s=120)
    torch.manual_seed(13)
    row = torch.randn(1, WIDTH)
    with torch.inference_mode():
        expected = old(row)[0]
    for _ in range(6):
        answer = server.predict("wide_ipc", json.dumps(row[0].tolist()).encode())
        assert answer.status_code == 200, answer.text
        assert torch.allclose(torch.tensor(answer.json()), expected, rtol=0, atol=1e-5)
    for pid in (int(w["pid"]) for w in server.describe("wide_ipc")["workers"]):  # type: ignore[attr-defined]
        assert file_mapping(pid, path.name).get("Rss", 0) >= 0.9 * path.stat().st_size


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_second_worker_sharing_through_cuda_ipc_adds_no_copy_of_the_weights(
        tmp_path: Path, model_store: Path, weights: tuple[Path, Any],
        start_server: Callable[..., RunningServer]) -> None:
    # The GPU's memory a second worker adds, sharing (cuda_ipc) and copying (false): the
    # sharing one adds most of the weights' 64 MiB less, and answers as the model does.
    from benchmarks.gpu_load import gpu_memory_mib

    path, old = weights
    row = torch.randn(1, WIDTH)
    with torch.inference_mode():
        expected = old(row)[0]
    body = json.dumps(row[0].tolist()).encode()
    extra: dict[str, float] = {}
    for name, sharing in (("gpu_ipc", "cuda_ipc"), ("gpu_copy", "false")):
        archive(tmp_path, model_store, name, path, f"""
            minWorkers: 1
            maxWorkers: 1
            handler:
              share_weights: {sharing}
            """)
        server = start_server(f"{name}.mar", number_of_gpu=1)
        assert server.predict(name, body).status_code == 200
        one = gpu_memory_mib()
        scaled = requests.put(f"{server.management}/models/{name}", timeout=120, params={
            "min_worker": 2, "max_worker": 2, "synchronous": "true"})
        assert scaled.status_code == 200, scaled.text
        for _ in range(6):
            reply = server.predict(name, body)
            assert reply.status_code == 200, reply.text
            assert torch.allclose(torch.tensor(reply.json()), expected, rtol=0, atol=1e-4)
        two = gpu_memory_mib()
        assert one is not None and two is not None
        extra[sharing] = two - one
    assert extra["false"] - extra["cuda_ipc"] >= 0.7 * path.stat().st_size / MIB, extra
