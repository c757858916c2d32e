"""Whole-server memory of the ResNet-152 example with 1, 2 and 4 CPU workers: the
proportional set size (Pss: a page shared by n processes counts 1/n in each) of the server
process and every process under it, summed from /proc/PID/smaps_rollup.

    .venv/bin/python -m benchmarks.memory                 # the weights shared (the default)
    .venv/bin/python -m benchmarks.memory --copy          # share_weights: false (a copy each)
    .venv/bin/python -m benchmarks.memory --pythonpath DIR  # another checkout's code, e.g. the
                                                          # commit before: git archive | tar -x

It starts ``torchserve --start`` with no model, registers the example's archive
(``examples/image_classifier/resnet_152_batch/build_mar.py``; batch_size 1, so that concurrent
requests reach every worker), scales it with the management API (``PUT /models/{name}?
min_worker=N&synchronous=true``), sends each worker requests (a worker's mapped weights
count once it has read them), and reads the processes' Pss.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import urllib.parse
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from benchmarks.resnet152 import EXAMPLE, IMAGES, MODEL, build_archive
from benchmarks.servers import Batchserve

MIB = 1 << 20
COPY_CONFIG = "handler:\n  share_weights: false\n"


def pss(pid: int) -> int:
    """Pss of one process in bytes (0 when it has gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def server_pss(server_pid: int) -> tuple[int, int, list[int]]:
    """Pss of the server's whole process tree, of the server process alone, and of each of
    the processes under it."""
    children = psutil.Process(server_pid).children(recursive=True)
    own = pss(server_pid)
    others = [pss(child.pid) for child in children]
    return own + sum(others), own, others


def copy_archive(archive: Path, store: Path) -> Path:
    """The archive again, with a model config that says ``share_weights: false``."""
    from model_archiver.packaging import ArchiveFormat, ArchiveOptions
    from model_archiver.packaging import build_archive as pack

    with tempfile.TemporaryDirectory(prefix="resnet152-copy-") as tmp:
        with zipfile.ZipFile(archive) as source:
            source.extract("resnet152.pt", tmp)
        config = Path(tmp) / "model-config.yaml"
        config.write_text(COPY_CONFIG)
        return pack(ArchiveOptions(
            model_name=f"{MODEL}-copy", version="2.0", model_file=str(EXAMPLE / "model.py"),
            serialized_file=str(Path(tmp) / "resnet152.pt"), handler="image_classifier",
            extra_files=(str(EXAMPLE / "index_to_name.json"),), config_file=str(config),
            export_path=store, archive_format=ArchiveFormat.ZIP_STORE, force=True))


def put(url: str) -> None:
    request = urllib.request.Request(url, method="PUT")
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()


def predict(server: Batchserve, name: str) -> None:
    request = urllib.request.Request(f"{server.inference}/predictions/{name}",
                                     data=IMAGES[0], method="POST",
                                     headers={"Content-Type": "image/jpeg"})
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()


def exercise(server: Batchserve, name: str, workers: int, rounds: int = 3) -> None:
    """``rounds`` bursts of 2 x ``workers`` concurrent requests: every worker gets some."""
    with ThreadPoolExecutor(2 * workers) as pool:
        for _ in range(rounds):
            list(pool.map(lambda _: predict(server, name), range(2 * workers)))


def measure(archive: Path, name: str, counts: list[int], env: dict[str, str]) -> list[str]:
    rows = []
    with Batchserve(archive.parent, env=env) as server:
        server_pid = int(server.state["pid"])  # type: ignore[call-overload]
        server.register(archive.name, initial_workers=counts[0], batch_size=1)
        for count in counts:
            put(f"{server.management}/models/{urllib.parse.quote(name)}?"
                f"min_worker={count}&max_worker={count}&synchronous=true")
            exercise(server, name, count)
            time.sleep(1)  # the last answers' buffers freed before reading
            total, own, others = server_pss(server_pid)
            workers = ", ".join(f"{value / MIB:.0f}" for value in sorted(others))
            rows.append(f"| {count} | {total / MIB:,.0f} | {own / MIB:.0f} | {workers} |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copy", action="store_true", help="share_weights: false")
    parser.add_argument("--pythonpath", type=Path,
                        help="run the server from this source tree (PYTHONPATH)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()

    store = Path(tempfile.mkdtemp(prefix="memory-store-"))
    try:
        archive = build_archive(store)
        name = MODEL
        if args.copy:
            archive, name = copy_archive(archive, store), f"{MODEL}-copy"
        env = dict(os.environ)
        if args.pythonpath:
            env["PYTHONPATH"] = str(args.pythonpath.resolve())
        print("| workers | whole server Pss (MiB) | frontend | each worker (+ helpers) |")
        print("| --- | --- | --- | --- |")
        measure(archive, name, args.workers, env)
    finally:
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()
