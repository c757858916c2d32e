"""ResNet-152 throughput: batchserve against the raw model in one process (the ceiling).

Both sides run the same handler code (decode, resize/crop/normalise, one forward pass per
batch, softmax, top-5, JSON): the raw side calls it in-process, the server side goes through
HTTP, the queue, the batcher and a worker subprocess. The ratio server/raw is the cost of
serving.

    .venv/bin/python -m benchmarks.resnet152 --duration 30
    .venv/bin/python -m benchmarks.resnet152 --compare-decode --duration 15   # tensor vs Pillow
    python -m benchmarks.resnet152 --device cuda --out gpu.json   # the GPU run: benchmarks/gpu.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from benchmarks.gpu import add_served_options
from benchmarks.load import run_load
from benchmarks.servers import Batchserve

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "image_classifier" / "resnet_152_batch"
MODEL = "resnet-152-batch_v2"
IMAGES = [(EXAMPLE / f"{name}.jpg").read_bytes() for name in ("kitten", "dog", "croco")]


def build_archive(store: Path) -> Path:
    spec = importlib.util.spec_from_file_location("resnet_build_mar", EXAMPLE / "build_mar.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path, _ = module.build_mar(store)
    return Path(path)


def raw_throughput(archive: Path, batch_size: int, duration_s: float,
                   image_decode: str | None = None) -> float:
    """Images per second through the handler in this process, batches of ``batch_size``."""
    from backend.service.model_service import load_service
    from protos import worker_pb2

    model_dir = Path(tempfile.mkdtemp(prefix="raw-resnet-"))
    with zipfile.ZipFile(archive) as mar:
        mar.extractall(model_dir)
    manifest = (model_dir / "MAR-INF" / "MANIFEST.json").read_text()
    if image_decode is not None:
        (model_dir / "model-config.yaml").write_text(f"handler:\n  image_decode: {image_decode}\n")
        document = json.loads(manifest)
        document["model"]["configFile"] = "model-config.yaml"
        manifest = json.dumps(document)
    service = load_service(worker_pb2.LoadModel(
        model_name=MODEL, model_version="2.0", model_dir=str(model_dir),
        handler=json.loads(manifest)["model"]["handler"], batch_size=batch_size, gpu_id=-1,
        manifest_json=manifest, limit_max_image_pixels=True, decode_input_request=True))

    def batch(start: int) -> worker_pb2.PredictBatch:
        message = worker_pb2.PredictBatch(batch_id=start)
        for i in range(batch_size):
            request = message.requests.add(request_id=f"r{start}-{i}")
            request.inputs["body"] = IMAGES[(start + i) % len(IMAGES)]
        return message

    service.predict(batch(0))  # warm up
    images = 0
    started = time.monotonic()
    while time.monotonic() - started < duration_s:
        result = service.predict(batch(images))
        assert all(r.status in (0, 200) and not r.error for r in result.responses)
        images += batch_size
    return images / (time.monotonic() - started)


def server_throughput(store: Path, batch_size: int, concurrency: int,
                      duration_s: float) -> tuple[float, str]:
    with Batchserve(store) as server:
        server.register(f"{MODEL}.mar", batch_size=batch_size, max_batch_delay=10,
                        initial_workers=1)
        result = run_load(f"{server.inference}/predictions/{MODEL}", IMAGES,
                          concurrency=concurrency, duration_s=duration_s, warmup_s=3.0,
                          content_type="image/jpeg")
        sizes = server.describe(MODEL)["batching"]["recentBatchSizes"]  # type: ignore[index]
        return result.throughput, f"{result.summary()}  recent batches {sizes[-8:]}"


def raw_in_subprocess(archive: Path, batch_size: int, duration_s: float,
                      image_decode: str | None = None) -> float:
    """Measure the raw side in a fresh process: a process that has run torch keeps OpenMP
    threads and memory around that would slow the server side measured after it."""
    output = subprocess.run(
        [sys.executable, "-m", "benchmarks.resnet152", "--raw", str(archive),
         "--batch-sizes", str(batch_size), "--duration", str(duration_s),
         *(["--image-decode", image_decode] if image_decode else [])],
        cwd=ROOT, check=True, capture_output=True, text=True, timeout=duration_s * 4 + 300)
    return float(output.stdout.split()[-1])


def pipeline_throughput(mode: str, batch_size: int, duration_s: float) -> float:
    """Images per second through the image pipeline alone (decode + resize/crop/normalise),
    on this process's CPU threads as a worker would use them."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from backend.handlers.images import ImagePipeline
    from backend.handlers.vision import IMAGENET_TRANSFORM, usable_cpus

    with ThreadPoolExecutor(min(usable_cpus(), batch_size)) as pool:
        pipeline = ImagePipeline(torch.device("cpu"), mode, pool,
                                 pil_transform=IMAGENET_TRANSFORM)
        blobs = [IMAGES[i % len(IMAGES)] for i in range(batch_size)]
        pipeline.batch(pipeline.load(blobs))  # type: ignore[arg-type]
        images = 0
        started = time.monotonic()
        while time.monotonic() - started < duration_s:
            pipeline.batch(pipeline.load(blobs))  # type: ignore[arg-type]
            images += batch_size
        return images / (time.monotonic() - started)


def compare_decode(archive: Path, batch_size: int, duration_s: float, rounds: int) -> None:
    """The tensor path against Pillow's: the pipeline alone and the whole handler, on the CPU,
    interleaved in fresh processes."""
    print("| round | pipeline tensor img/s | pipeline pil img/s | ratio | handler tensor img/s "
          "| handler pil img/s | ratio |\n|---|---|---|---|---|---|---|")
    for round_number in range(1, rounds + 1):
        pipeline = {mode: float(subprocess.run(
            [sys.executable, "-c", "from benchmarks.resnet152 import pipeline_throughput; "
             f"print(pipeline_throughput({mode!r}, {batch_size}, {duration_s}))"],
            cwd=ROOT, check=True, capture_output=True, text=True).stdout.split()[-1])
            for mode in ("tensor", "pil")}
        handler = {mode: raw_in_subprocess(archive, batch_size, duration_s, mode)
                   for mode in ("tensor", "pil")}
        print(f"| {round_number} | {pipeline['tensor']:.1f} | {pipeline['pil']:.1f} | "
              f"{pipeline['tensor'] / pipeline['pil']:.2f} | {handler['tensor']:.2f} | "
              f"{handler['pil']:.2f} | {handler['tensor'] / handler['pil']:.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per measurement")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3, help="server/raw pairs per batch size")
    parser.add_argument("--raw", type=Path, help=argparse.SUPPRESS)  # internal: raw side only
    parser.add_argument("--device", help="the GPU run (benchmarks/gpu.py): cuda, or cpu to "
                        "try its code paths")
    parser.add_argument("--quick", action="store_true", help="with --device: a short run")
    parser.add_argument("--out", type=Path, help="with --device: the results as JSON")
    add_served_options(parser)
    parser.add_argument("--image-decode", choices=("tensor", "pil"), help=argparse.SUPPRESS)
    parser.add_argument("--compare-decode", action="store_true",
                        help="the tensor path against Pillow's, on the CPU")
    args = parser.parse_args()
    if args.device is not None:
        from benchmarks.gpu import run_from_args

        run_from_args(args)
        return
    if args.raw is not None:
        print(raw_throughput(args.raw, args.batch_sizes[0], args.duration, args.image_decode))
        return
    store = Path(tempfile.mkdtemp(prefix="bench-store-"))
    archive = build_archive(store)
    if args.compare_decode:
        compare_decode(archive, args.batch_sizes[-1], args.duration, args.rounds)
        return
    print("| batch_size | round | raw img/s (before, after) | server img/s | server/raw |\n"
          "|---|---|---|---|---|")
    for batch_size in args.batch_sizes:
        ratios = []
        for round_number in range(1, args.rounds + 1):
            # Raw before and after the server run, averaged: the machine's speed drifts.
            before = raw_in_subprocess(archive, batch_size, args.duration)
            served, detail = server_throughput(store, batch_size, args.concurrency,
                                               args.duration)
            after = raw_in_subprocess(archive, batch_size, args.duration)
            raw = (before + after) / 2
            ratios.append(served / raw)
            print(f"| {batch_size} | {round_number} | {raw:.2f} ({before:.2f}, {after:.2f}) | "
                  f"{served:.2f} | {served / raw:.3f} |", flush=True)
            print(f"<!-- server: {detail} -->", flush=True)
        print(f"| {batch_size} | median | | | **{statistics.median(ratios):.3f}** |", flush=True)


if __name__ == "__main__":
    main()
