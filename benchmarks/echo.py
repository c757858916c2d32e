"""Echo throughput (server overhead): HTTP with `hey`, gRPC with an asyncio grpc.aio client.

    .venv/bin/python -m benchmarks.echo --duration 8 --concurrency 16

Both clients run on the same machine as the server (2 cores here), so part of the CPU goes to
the client: compare ratios within one run, not absolute numbers across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import grpc

from benchmarks.servers import Batchserve
from model_archiver.packaging import ArchiveOptions, build_archive
from protos import inference_pb2, inference_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
BODY = b"0123456789" * 10  # 100 bytes


def build_echo(store: Path) -> None:
    build_archive(ArchiveOptions(model_name="echo", version="1.0",
                                 handler=str(ROOT / "examples" / "echo" / "echo_handler.py"),
                                 export_path=store, force=True))


def http_throughput(url: str, concurrency: int, duration_s: float) -> tuple[float, str]:
    """Requests per second measured by `hey` (apt-get install hey)."""
    hey = shutil.which("hey")
    if hey is None:
        raise SystemExit("the HTTP side needs `hey` (apt-get install -y hey)")
    body = Path(tempfile.mkstemp(suffix=".bin")[1])
    body.write_bytes(BODY)
    output = subprocess.run(
        [hey, "-z", f"{duration_s}s", "-c", str(concurrency), "-m", "POST", "-D", str(body),
         "-T", "application/octet-stream", url],
        check=True, capture_output=True, text=True, timeout=duration_s + 120).stdout
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1))  # type: ignore[union-attr]
    p99 = re.search(r"99% in ([\d.]+) secs", output)
    return rate, f"p99 {float(p99.group(1)) * 1000:.1f} ms" if p99 else ""


async def _grpc_load(port: int, model: str, concurrency: int, duration_s: float) -> float:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        request = inference_pb2.PredictionsRequest(model_name=model, input={"body": BODY})
        await stub.Predictions(request)  # connect and warm up
        stop = time.monotonic() + duration_s
        counts = [0] * concurrency

        async def client(index: int) -> None:
            while time.monotonic() < stop:
                await stub.Predictions(request)
                counts[index] += 1

        started = time.monotonic()
        await asyncio.gather(*(client(i) for i in range(concurrency)))
        return sum(counts) / (time.monotonic() - started)


def grpc_throughput(port: int, model: str, concurrency: int, duration_s: float) -> float:
    return asyncio.run(_grpc_load(port, model, concurrency, duration_s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    store = Path(tempfile.mkdtemp(prefix="bench-echo-"))
    build_echo(store)
    print(f"| access log | transport | batch_size | req/s at {args.concurrency} concurrent | "
          "notes |\n|---|---|---|---|---|")
    for access_log in ("on", "off"):
        enabled = "true" if access_log == "on" else "false"
        with Batchserve(store, f"enable_access_log={enabled}\n") as server:
            for batch_size in (1, 8):
                server.register("echo.mar", model_name=f"echo_b{batch_size}",
                                batch_size=batch_size, max_batch_delay=5, initial_workers=1)
            grpc_port = int(server.state["grpc_inference_port"])  # type: ignore[call-overload]
            for batch_size in (1, 8):
                model = f"echo_b{batch_size}"
                rate, note = http_throughput(f"{server.inference}/predictions/{model}",
                                             args.concurrency, args.duration)
                print(f"| {access_log} | HTTP (hey) | {batch_size} | {rate:,.0f} | {note} |",
                      flush=True)
                rate = grpc_throughput(grpc_port, model, args.concurrency, args.duration)
                print(f"| {access_log} | gRPC (grpc.aio client) | {batch_size} | {rate:,.0f} | |",
                      flush=True)


if __name__ == "__main__":
    main()
