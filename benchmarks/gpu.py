"""ResNet-152 on a GPU (issue 14): the in-process ceilings, then the server across batch
sizes, workers and precisions, with the GPU's utilisation sampled during every served run.

    python -m benchmarks.resnet152 --device cuda --out gpu.json          # about 20 minutes
    python -m benchmarks.resnet152 --device cuda --quick --out gpu.json  # about 6 minutes
    python -m benchmarks.resnet152 --device cpu --quick                  # the code paths, on a CPU

Ceilings (one process, no server): the forward pass alone (fp32; bf16 autocast +
channels_last), the image pipeline alone (nvJPEG batch decode + resize/crop/normalise on the
GPU: ``backend.handlers.images``), and the whole handler in process (pipeline + forward +
top-5), which is what the server can at best reach. Served: closed-loop HTTP clients in
several processes post the three test JPEGs (kitten, dog, croco) to a real ``torchserve
--start``; ``max_batch_delay`` 10 ms, the adaptive policy; fp32 at batch 8/32/64 with 1, 2
and 4 workers; bf16 + channels_last at 64 and 128; the lone client at batch 1 (p50 against
the in-process latency of one image's decode and forward). Targets (issue 14): >= 1,500 img/s
fp32, >= 2,500 bf16, 2 workers >= 1, lone-client p50 <= 19.6 ms, GPU >= 80 % busy at
saturation.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import zipfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.load import LoadResult, run_load
from benchmarks.servers import Batchserve

#: model-config.yaml per variant: the precision first (``benchmarks/gpu_result.py`` reads
#: it), then what differs (CUDA graphs off; the weights shared through CUDA IPC).
VARIANTS = {
    "fp32": "handler: {}\n",
    "bf16": "handler:\n  amp: bf16\n  channels_last: true\n",
    "bf16-eager": "handler:\n  amp: bf16\n  channels_last: true\n  cuda_graphs: false\n",
    "fp32-ipc": "handler:\n  share_weights: cuda_ipc\n",
}


def model_folder(store: Path, archive: Path, variant: str, prefix: str = "resnet152") -> str:
    """The archive unpacked as a folder model in ``store`` with the variant's model-config."""
    name = f"{prefix}-{variant}"
    folder = store / name
    if folder.exists():
        shutil.rmtree(folder)
    with zipfile.ZipFile(archive) as mar:
        mar.extractall(folder)
    (folder / "model-config.yaml").write_text(VARIANTS[variant])
    manifest_path = folder / "MAR-INF" / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["model"]["configFile"] = "model-config.yaml"
    manifest["model"]["modelName"] = name
    manifest_path.write_text(json.dumps(manifest))
    return name


# ---- in-process ceilings ---------------------------------------------------------------------


def _timed(step: Any, device: str, seconds: float) -> float:
    """Calls of ``step`` per second, after a warm-up, with the device synchronised."""
    import torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for _ in range(3):
        step()
    sync()
    calls = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        step()
        calls += 1
    sync()
    return calls / (time.perf_counter() - started)


def ceilings(folder: Path, device: str, images: list[bytes], seconds: float,
             quick: bool) -> list[dict[str, Any]]:
    import torch

    from backend.handlers.images import TENSOR, ImagePipeline
    from backend.weights import load_model

    manifest = json.loads((folder / "MAR-INF" / "MANIFEST.json").read_text())
    model = load_model(folder, manifest, torch.device(device)).eval()
    rows: list[dict[str, Any]] = []
    forward_sizes = [(32, "fp32"), (64, "fp32"), (64, "bf16"), (128, "bf16")]
    if quick or not device.startswith("cuda"):
        forward_sizes = [(8, "fp32"), (8, "bf16")]
    for batch, precision in forward_sizes:
        net = model.to(memory_format=torch.channels_last) if precision == "bf16" else model
        data = torch.randn(batch, 3, 224, 224, device=device)
        if precision == "bf16":
            data = data.contiguous(memory_format=torch.channels_last)

        def forward(net: Any = net, data: Any = data, precision: str = precision) -> None:
            with torch.inference_mode(), torch.autocast(
                    device.split(":")[0], dtype=torch.bfloat16, enabled=precision == "bf16"):
                net(data)

        rate = _timed(forward, device, seconds) * batch
        rows.append({"what": f"forward only, {precision}", "batch": batch, "img_s": rate})
        print(f"  forward {precision} batch {batch}: {rate:.0f} img/s", flush=True)
    pipeline = ImagePipeline(torch.device(device), TENSOR)
    batch = 64 if device.startswith("cuda") and not quick else 8
    blobs = [images[i % len(images)] for i in range(batch)]
    rate = _timed(lambda: pipeline.batch(pipeline.load(blobs)), device, seconds) * batch  # type: ignore[arg-type]
    rows.append({"what": "image pipeline only (decode + resize/crop/normalise)", "batch": batch,
                 "img_s": rate})
    print(f"  pipeline batch {batch}: {rate:.0f} img/s", flush=True)
    return rows


def handler_ceiling(folder: Path, device: str, images: list[bytes], batch: int,
                    seconds: float) -> float:
    """Images per second through the whole handler in this process (ModelService)."""
    from backend.service.model_service import load_service
    from protos import worker_pb2

    manifest = (folder / "MAR-INF" / "MANIFEST.json").read_text()
    service = load_service(worker_pb2.LoadModel(
        model_name=folder.name, model_version="1", model_dir=str(folder),
        handler="image_classifier", batch_size=batch, gpu_id=0 if device.startswith("cuda")
        else -1, manifest_json=manifest, limit_max_image_pixels=True,
        decode_input_request=True))
    message = worker_pb2.PredictBatch(batch_id=1)
    for i in range(batch):
        message.requests.add(request_id=f"r{i}").inputs["body"] = images[i % len(images)]
    return _timed(lambda: service.predict(message), device, seconds) * batch


def lone_latency_ms(folder: Path, device: str, images: list[bytes], seconds: float) -> float:
    """p50 of one image through the handler in process: its decode plus its forward pass."""
    from backend.service.model_service import load_service
    from protos import worker_pb2

    manifest = (folder / "MAR-INF" / "MANIFEST.json").read_text()
    service = load_service(worker_pb2.LoadModel(
        model_name=folder.name, model_version="1", model_dir=str(folder),
        handler="image_classifier", batch_size=1,
        gpu_id=0 if device.startswith("cuda") else -1, manifest_json=manifest,
        limit_max_image_pixels=True, decode_input_request=True))
    latencies = []
    deadline = time.monotonic() + seconds
    index = 0
    while time.monotonic() < deadline:
        message = worker_pb2.PredictBatch(batch_id=index)
        message.requests.add(request_id="r").inputs["body"] = images[index % len(images)]
        started = time.perf_counter()
        service.predict(message)  # returns JSON: the GPU work is done
        latencies.append(time.perf_counter() - started)
        index += 1
    return statistics.median(latencies[3:] or latencies) * 1000


# ---- served ------------------------------------------------------------------------------


class GpuSampler:
    """Samples the GPU's utilisation (nvidia-ml-py, else nvidia-smi) every 100 ms."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> Any:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception:
            if shutil.which("nvidia-smi") is None:
                return None
            return lambda: float(subprocess.run(
                ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                 "-i", "0"], capture_output=True, text=True, timeout=5).stdout.split()[0])

    def _run(self) -> None:
        read = self._read()
        while read is not None and not self._stop.wait(0.1):
            try:
                self.samples.append(read())
            except Exception:
                return

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.samples) if self.samples else None


def _load_part(args: tuple[str, list[bytes], int, float, float]) -> LoadResult:
    url, bodies, clients, seconds, warmup = args
    return run_load(url, bodies, concurrency=clients, duration_s=seconds, warmup_s=warmup,
                    content_type="image/jpeg")


def load_from_processes(url: str, bodies: list[bytes], clients: int, seconds: float,
                        warmup_s: float) -> LoadResult:
    """Closed-loop clients spread over processes (one Python process cannot post thousands of
    images a second); their results merged."""
    processes = max(1, min(8, clients // 8))
    shares = [clients // processes + (1 if i < clients % processes else 0)
              for i in range(processes)]
    with ProcessPoolExecutor(processes) as pool:
        parts = list(pool.map(_load_part, [(url, bodies, share, seconds, warmup_s)
                                           for share in shares]))
    merged = LoadResult(clients, seconds)
    for part in parts:
        merged.latencies_s.extend(part.latencies_s)
        for status, count in part.statuses.items():
            merged.statuses[status] = merged.statuses.get(status, 0) + count
    return merged


def _py_spy(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
    """py-spy sampling worker ``pid`` (every thread, idle ones too) into ``out``."""
    if shutil.which("py-spy") is None:
        print("  (no py-spy: not profiled)", flush=True)
        return None
    return subprocess.Popen(["py-spy", "record", "-p", str(pid), "-d", str(int(seconds)),
                             "-f", "raw", "--threads", "--idle", "--nonblocking", "-o",
                             str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def served(server: Batchserve, name: str, images: list[bytes], batch: int, workers: int,
           clients: int, seconds: float, profile: Path | None = None) -> dict[str, Any]:
    server.register(name, model_name=f"{name}-b{batch}-w{workers}", batch_size=batch,
                    max_batch_delay=10, initial_workers=workers)
    model = f"{name}-b{batch}-w{workers}"
    url = f"{server.inference}/predictions/{model}"
    spy = None
    if profile is not None:  # the first worker, while the measured load runs
        pid = server.describe(model)["workers"][0]["pid"]  # type: ignore[index]
        spy = _py_spy(pid, seconds + 5.0, profile / f"{model}.txt")
    with GpuSampler() as gpu:
        result = load_from_processes(url, images, clients, seconds, warmup_s=5.0)
    if spy is not None:
        spy.wait(timeout=60)
    sizes = server.describe(model)["batching"]["recentBatchSizes"]  # type: ignore[index]
    server.unregister(model)
    row = {"model": name, "batch": batch, "workers": workers, "clients": clients,
           "img_s": result.throughput, "p50_ms": result.percentile_ms(50),
           "p99_ms": result.percentile_ms(99), "gpu_busy_pct": gpu.mean,
           "statuses": result.statuses, "recent_batches": sizes[-8:]}
    print(f"  {model}: {result.summary()}  GPU {gpu.mean}  batches {sizes[-8:]}", flush=True)
    return row


def parse_plan(text: str) -> list[tuple[str, int, int]]:
    """``bf16:64:1,fp32:32:2``: the served runs, as variant:batch:workers."""
    plan = []
    for item in text.split(","):
        variant, batch, workers = item.split(":")
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r} (one of {', '.join(VARIANTS)})")
        plan.append((variant, int(batch), int(workers)))
    return plan


def run(device: str, quick: bool, seconds: float, out: Path | None,
        plan: list[tuple[str, int, int]] | None = None, in_process: bool = True,
        properties: str = "", profile: Path | None = None) -> None:
    from benchmarks.resnet152 import IMAGES, build_archive

    store = Path(tempfile.mkdtemp(prefix="gpu-bench-store-"))
    archive = build_archive(store)
    names = {variant: model_folder(store, archive, variant) for variant in VARIANTS
             if variant in ("fp32", "bf16") or (plan and variant in {v for v, _, _ in plan})}
    report: dict[str, Any] = {"device": device, "quick": quick}

    report["ceilings"] = []
    if in_process:
        print("ceilings (in process):", flush=True)
        report["ceilings"] = ceilings(store / names["fp32"], device, IMAGES, seconds / 3,
                                      quick)
        handler_batches = [("fp32", 8)] if quick or not device.startswith("cuda") else [
            ("fp32", 32), ("fp32", 64), ("bf16", 64), ("bf16", 128)]
        for variant, batch in handler_batches:
            rate = handler_ceiling(store / names[variant], device, IMAGES, batch, seconds / 3)
            report["ceilings"].append({"what": f"whole handler in process, {variant}",
                                       "batch": batch, "img_s": rate})
            print(f"  handler {variant} batch {batch}: {rate:.0f} img/s", flush=True)
        report["lone_in_process_ms"] = lone_latency_ms(store / names["fp32"], device, IMAGES,
                                                       seconds / 3)
        print(f"  one image in process: {report['lone_in_process_ms']:.1f} ms", flush=True)

    if plan is None:
        plan = [("fp32", 8, 1), ("fp32", 32, 1), ("fp32", 64, 1), ("fp32", 32, 2),
                ("fp32", 32, 4), ("fp32", 64, 2), ("bf16", 64, 1), ("bf16", 128, 1),
                ("bf16", 128, 2)]
        if quick or not device.startswith("cuda"):
            plan = [("fp32", 8, 1), ("fp32", 8, 2), ("bf16", 8, 1)]
    # The queue holds every client's request (TorchServe's default, 100, would turn the
    # clients of a batch of 128 away with 503s and cap the batches).
    properties = ("number_of_gpu=1\n" if device.startswith("cuda") else "number_of_gpu=0\n") \
        + "job_queue_size=1024\n" + properties
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
    rows = []
    print("served (HTTP, closed loop):", flush=True)
    with Batchserve(store, properties) as server:
        report["lone_served_p50_ms"] = lone_served_ms(server, names["fp32"], IMAGES, seconds)
        for variant, batch, workers in plan:
            clients = min(256, 2 * batch * workers)
            try:
                rows.append(served(server, names[variant], IMAGES, batch, workers, clients,
                                   seconds, profile))
            except Exception as error:  # one broken run must not cost the rest (a GPU lease)
                print(f"  {variant} batch {batch} workers {workers}: FAILED {error!r}",
                      flush=True)
                rows.append({"model": names[variant], "batch": batch, "workers": workers,
                             "clients": clients, "error": repr(error)})
    report["served"] = rows
    print_markdown(report)
    if out is not None:
        out.write_text(json.dumps(report, indent=2))


def lone_served_ms(server: Batchserve, name: str, images: list[bytes], seconds: float) -> float:
    """p50 of one client posting one image at a time to a batch-1 model (run first, on an
    idle GPU)."""
    server.register(name, model_name="lone", batch_size=1, max_batch_delay=10,
                    initial_workers=1)
    lone = run_load(f"{server.inference}/predictions/lone", images, concurrency=1,
                    duration_s=seconds, warmup_s=3.0, content_type="image/jpeg")
    server.unregister("lone")
    print(f"  lone client, batch 1: {lone.summary()}", flush=True)
    return lone.percentile_ms(50)


def print_markdown(report: dict[str, Any]) -> None:
    print("\n| in process | batch | img/s |\n|---|---|---|")
    for row in report["ceilings"]:
        print(f"| {row['what']} | {row['batch']} | {row['img_s']:.0f} |")
    print("\n| model | batch | workers | clients | img/s | p50 ms | p99 ms | GPU busy % |"
          "\n|---|---|---|---|---|---|---|---|")
    for row in report["served"]:
        if "error" in row:
            print(f"| {row['model']} | {row['batch']} | {row['workers']} | {row['clients']} | "
                  f"failed: {row['error'][:80]} | | | |")
            continue
        gpu = f"{row['gpu_busy_pct']:.0f}" if row["gpu_busy_pct"] is not None else "-"
        print(f"| {row['model']} | {row['batch']} | {row['workers']} | {row['clients']} | "
              f"{row['img_s']:.0f} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | {gpu} |")
    in_process = report.get("lone_in_process_ms")
    print(f"\nlone client at batch 1: served p50 {report['lone_served_p50_ms']:.1f} ms"
          + (f"; one image's decode + forward in process {in_process:.1f} ms"
             if in_process is not None else ""))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per served run")
    parser.add_argument("--out", type=Path)
    add_served_options(parser)
    run_from_args(parser.parse_args(argv))


def run_from_args(args: argparse.Namespace) -> None:
    run(args.device, args.quick, args.duration, args.out, args.plan, not args.no_in_process,
        args.properties.replace(";", "\n") + "\n", args.profile)


def add_served_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", type=parse_plan, help="the served runs, as "
                        "variant:batch:workers,... (variants: fp32, bf16)")
    parser.add_argument("--no-in-process", action="store_true",
                        help="skip the in-process ceilings")
    parser.add_argument("--properties", default="",
                        help="config.properties lines for the server, ';'-separated")
    parser.add_argument("--profile", type=Path,
                        help="py-spy each served run's first worker into this folder")


if __name__ == "__main__":
    main()
