"""ResNet-18 served four ways (issue 37): eager (model.py + state dict), TorchScript, a
torch.export ExportedProgram and an AOTInductor package, the last two made by
``batchserve-export`` from the eager model. torchvision's architecture with seeded weights (no
download here).

On one server (``image_classifier``, one worker, batch_size 8, max_batch_delay 10 ms), in
``--rounds`` rounds, each archive in a shuffled order: registered (the load time: the
synchronous registration, until the worker is READY), loaded by ``--clients`` closed-loop
clients for ``--duration`` seconds, unregistered; medians of the rounds. In the first round
each test JPEG's answer is compared with the eager archive's (the same top-5 classes in the
same order, probabilities within ``--tolerance``), sent alone and all at once (a batch).

    .venv/bin/python -m benchmarks.pt2                     # ~6 min the first time (compile)
    .venv/bin/python -m benchmarks.pt2 --work /tmp/pt2b    # reuses the exported files there

The export (and AOTInductor's compile) happens once per ``--work`` folder; its report (the
exporter's own comparison on random batches) is printed too.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.jpegs import natural_jpeg
from benchmarks.loadgen import HttpTarget, run
from benchmarks.servers import BIN, Batchserve

MODEL_PY = '''import torchvision


class ResNet18(torchvision.models.ResNet):
    def __init__(self) -> None:
        super().__init__(torchvision.models.resnet.BasicBlock, [2, 2, 2, 2])
'''
KINDS = ("eager", "torchscript", "exported_program", "aotinductor")


def prepare(work: Path, max_batch: int) -> dict[str, Path]:
    """The four serialized models in ``work`` (made once), and the exporter's report."""
    import torch

    sys.path.insert(0, str(work))
    (work / "model.py").write_text(MODEL_PY)
    weights, script = work / "resnet18.pt", work / "resnet18_ts.pt"
    if not weights.exists():
        from model import ResNet18  # type: ignore[import-not-found]

        torch.manual_seed(0)
        model = ResNet18().eval()
        torch.save(model.state_dict(), weights)
        torch.jit.save(torch.jit.trace(model, torch.randn(1, 3, 224, 224)), str(script))
    exported, aoti = work / "resnet18.export.pt2", work / "resnet18.aoti.pt2"
    if not aoti.exists():
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "backend.weights.export", "--model-file",
                        str(work / "model.py"), "--serialized-file", str(weights),
                        "--model-name", "resnet18", "--export-path", str(work),
                        "--max-batch", str(max_batch),
                        "--report", str(work / "export.json")], check=True)
        print(f"exported both kinds in {time.perf_counter() - started:.0f} s")
    return {"eager": weights, "torchscript": script, "exported_program": exported,
            "aotinductor": aoti}


def archive(store: Path, work: Path, kind: str, serialized: Path) -> str:
    name = f"resnet18_{kind}"
    model_file = ["--model-file", str(work / "model.py")] if kind == "eager" else []
    subprocess.run([str(BIN / "model-archiver"), "--model-name", name, "--version", "1",
                    *model_file, "--serialized-file", str(serialized), "--handler",
                    "image_classifier", "--export-path", str(store), "--force"],
                   check=True, stdout=subprocess.DEVNULL)
    return name


def predict(url: str, body: bytes) -> dict[str, float]:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "image/jpeg"})
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, float] = json.loads(response.read())
    return answer


def differences(answers: Sequence[dict[str, float]],
                reference: Sequence[dict[str, float]]) -> tuple[int, float]:
    """How many answers have the reference's top-5 classes in its order, and the largest
    probability difference over those classes."""
    same, largest = 0, 0.0
    for got, want in zip(answers, reference, strict=True):
        same += list(got) == list(want)
        largest = max(largest, *(abs(got.get(label, 0.0) - p) for label, p in want.items()))
    return same, largest


def measure(server: Batchserve, name: str, images: list[bytes], args: argparse.Namespace,
            check: bool) -> dict[str, Any]:
    """One round of one archive: registered, (``check``: answered lone and batched,) loaded
    with clients, unregistered."""
    started = time.perf_counter()
    server.register(f"{name}.mar", batch_size=8, max_batch_delay=10, initial_workers=1)
    load_s = time.perf_counter() - started
    url = f"{server.inference}/predictions/{name}"
    measured: dict[str, Any] = {"load_s": load_s}
    if check:
        measured["lone"] = [predict(url, body) for body in images]
        with ThreadPoolExecutor(len(images)) as pool:  # arrive together: batched
            measured["batched"] = list(pool.map(lambda body: predict(url, body), images))
        measured["described"] = server.describe(name)
    result = run(HttpTarget(url, images, "image/jpeg"), clients=args.clients,
                 duration_s=args.duration, warmup_s=args.warmup, progress=False)
    server.unregister(name)
    measured.update(throughput=result.throughput, p50_ms=result.percentile_ms(0.5),
                    errors=result.errors)
    return measured


def _median(values: list[float]) -> float:
    return statistics.median(values)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/batchserve-pt2-bench"))
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of the four, each in a shuffled order; medians reported")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    files = prepare(args.work, args.max_batch)
    store = args.work / "store"
    store.mkdir(exist_ok=True)
    names = {kind: archive(store, args.work, kind, files[kind]) for kind in KINDS}
    images = [natural_jpeg(320, 240, seed) for seed in range(args.images)]
    rounds: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    shuffler = random.Random(0)
    with Batchserve(store, "default_workers_per_model=1\n") as server:
        for round_index in range(args.rounds):
            order = list(KINDS)
            shuffler.shuffle(order)
            for kind in order:
                rounds[kind].append(measure(server, names[kind], images, args,
                                            check=round_index == 0))
    results = {kind: {**measured[0],
                      "load_s": _median([m["load_s"] for m in measured]),
                      "throughput": _median([m["throughput"] for m in measured]),
                      "p50_ms": _median([m["p50_ms"] for m in measured]),
                      "errors": sum(sum(m["errors"].values()) for m in measured),
                      "all": [(round(m["load_s"], 2), round(m["throughput"], 1))
                              for m in measured]}
               for kind, measured in rounds.items()}
    reference = results["eager"]["lone"]
    print("| model | file MB | load s | req/s | p50 ms | same top-5 (lone, batched) "
          "| largest probability difference | errors | rounds (load s, req/s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    failed = False
    for kind in KINDS:
        got = results[kind]
        lone_same, lone_diff = differences(got["lone"], reference)
        batch_same, batch_diff = differences(got["batched"], reference)
        largest = max(lone_diff, batch_diff)
        failed |= (lone_same < len(images) or batch_same < len(images)
                   or largest > args.tolerance)
        size = files[kind].stat().st_size / 2**20
        print(f"| {kind} | {size:.1f} | {got['load_s']:.2f} | {got['throughput']:.1f} "
              f"| {got['p50_ms']:.0f} | {lone_same}/{len(images)}, {batch_same}/{len(images)} "
              f"| {largest:.2e} | {got['errors']} | {got['all']} |")
    for kind in ("exported_program", "aotinductor"):
        workers: Any = results[kind]["described"].get("workers") or []
        print(f"{kind}: {[worker.get('execution') for worker in workers]}")
    report = args.work / "export.json"
    if report.exists():
        print("exporter's report:", report.read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
