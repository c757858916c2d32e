"""The GPU check's measurements (issue 33), one step per call, each within its time budget;
every served run becomes a row of ``OUT/results.json``, from which
``benchmarks/gpu_result.py`` makes the RESULT line. ``benchmarks/gpu_check.sh`` runs the steps
one by one, each under ``timeout``, so that one that hangs costs only its own budget.

    python -m benchmarks.gpu_check resnet152 --out /tmp/gpu-out --budget 170 --profile
    python -m benchmarks.gpu_check resnet50 --out /tmp/gpu-out --budget 80
    python -m benchmarks.gpu_check torchserve --out /tmp/gpu-out --budget 90
    python -m benchmarks.gpu_check ipc --out /tmp/gpu-out --budget 80
    python -m benchmarks.gpu_check all --device cpu --tiny --no-torchserve --out /tmp/dry

Steps (served over HTTP by a real ``torchserve --start``, closed-loop clients in several
processes, ``max_batch_delay`` 10 ms, the GPU's utilisation sampled during each run):

* ``resnet152``: the lone client (batch 1, fp32, one image at a time: p50), then ResNet-152
  at saturation: bf16 + channels_last at batch 128 with 1 and 2 workers (py-spy on the first
  one's worker with ``--profile``), fp32 at batch 64 with 1 and 2 workers, and, time
  permitting, bf16 with CUDA graphs off (the same profile, for the difference). The three
  test JPEGs (kitten, dog, croco), as issue 14's runs.
* ``resnet50``: ResNet-50, bf16 + channels_last, on ImageNet-sized JPEGs made here
  (``benchmarks/jpegs.py``), 256 clients, batch 128 and 64, 2 workers, and 1.
* ``ipc``: ResNet-152 fp32 with ``share_weights: cuda_ipc``: 1, then 2, then 4 workers of one
  model (scaled up), the GPU's memory in use and the throughput at each; then, time
  permitting, the same without sharing at 1 and 4 workers (memory only).
* ``torchserve``: TorchServe 0.12 (``benchmarks.torchserve.find_install``: skipped, saying
  why, where there is none) on the same ResNet-152 archive and JPEGs: batch 32 and 8 with one
  worker, 16 with 2 and 4.

``--tiny`` (with ``--device cpu``) swaps the models for a tiny convnet under the same names,
the JPEGs for small ones and each step's plan for its fewest runs (ResNet-152: the lone client
and bf16; ResNet-50: one; ipc: 1 then 2 sharing workers); ``all`` runs every step in one call
sharing one server: the dry run of gpu_check.sh, a few seconds of serving on a CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import gpu_load
from benchmarks.gpu import GpuSampler, model_folder
from benchmarks.gpu_result import (
    BATCHSERVE,
    LONE,
    RESNET50,
    RESNET152,
    SATURATION,
    TORCHSERVE,
    load_results,
)
from benchmarks.management import ManagementClient
from benchmarks.servers import Batchserve

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "image_classifier"
TEST_JPEGS = tuple(EXAMPLES / "resnet_152_batch" / f"{name}.jpg"
                   for name in ("kitten", "dog", "croco"))
MAX_BATCH_DELAY_MS = 10
MAX_CLIENTS = 256
#: What one served run costs beyond its warm-up and window (registering, capturing graphs,
#: unregistering), estimated: a run that would not fit the time left is skipped.
REGISTER_S = {"cuda": 35.0, "cpu": 5.0}

Plan = list[tuple[str, int, int]]  # (variant, batch size, workers)


@dataclass
class Check:
    """One step's settings and clock."""

    out: Path
    device: str = "cuda"
    tiny: bool = False
    duration_s: float = 5.0
    warmup_s: float = 3.0
    budget_s: float = 600.0
    profile: bool = False
    #: False: TorchServe is not looked for (the dry run in the tests: it says so).
    torchserve: bool = True
    #: The server every step uses (``all``: one server start, not one a step).
    shared: Batchserve | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def store(self) -> Path:
        return self.out / "store"

    @property
    def processes(self) -> int:
        return 1 if not self.cuda else max(1, min(8, (os.cpu_count() or 2) // 2))

    def time_left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def run_cost_s(self) -> float:
        return REGISTER_S["cuda" if self.cuda else "cpu"] + self.warmup_s + self.duration_s \
            + gpu_load.start_s(self.processes) + 5.0

    def batchserve(self) -> contextlib.AbstractContextManager[Batchserve]:
        """A batchserve for a step (the one all steps share, with ``all``), its logs' folder
        listed in ``OUT/servers.txt`` (what gpu_check.sh packs: this run's servers' logs,
        nobody else's)."""
        if self.shared is not None:
            return contextlib.nullcontext(self.shared)
        server = Batchserve(self.store, properties(self))
        self.keep_logs(server.work / "logs")
        return server

    def keep_logs(self, folder: Path) -> None:
        with (self.out / "servers.txt").open("a") as listing:
            listing.write(f"{folder}\n")

    def affords(self, what: str) -> bool:
        """Whether one more run fits the budget (said when it does not)."""
        if self.time_left() >= self.run_cost_s():
            return True
        print(f"  {what}: skipped, {self.time_left():.0f} s left of the step's budget",
              flush=True)
        self.note(f"{what}: skipped (out of time)")
        return False

    # -- results.json ---------------------------------------------------------------------

    @property
    def results(self) -> Path:
        return self.out / "results.json"

    def _update(self, change: Callable[[dict[str, Any]], None]) -> None:
        document = load_results(self.results)
        if document["card"] is None:
            document["card"] = gpu_load.card_name(self.device)
        change(document)
        partial = self.results.with_suffix(".partial")
        partial.write_text(json.dumps(document, indent=1))
        os.replace(partial, self.results)

    def record(self, row: dict[str, Any]) -> dict[str, Any]:
        self._update(lambda document: document["rows"].append(row))
        return row

    def note(self, text: str) -> None:
        self._update(lambda document: document["notes"].append(text))


# -- archives and images ----------------------------------------------------------------------


TINY_MODEL = '''\
"""A tiny convnet standing in for ResNet-152/50 in the dry run (ImageNet's 1000 classes)."""

import torch


class TinyNet(torch.nn.Sequential):
    def __init__(self) -> None:
        super().__init__(torch.nn.Conv2d(3, 8, 8, stride=8), torch.nn.ReLU(),
                         torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                         torch.nn.Linear(8, 1000))
'''
ARCHIVE_NAMES = {RESNET152: "resnet-152-batch_v2", RESNET50: "resnet-50"}


def archive(check: Check, model: str) -> Path:
    """The model's ``.mar`` in the check's store, built once (the examples' builders: seeded
    weights; ``--tiny``: a tiny convnet under the same name)."""
    path = check.store / f"{ARCHIVE_NAMES[model]}.mar"
    if path.exists():
        return path
    check.store.mkdir(parents=True, exist_ok=True)
    if check.tiny:
        return _tiny_archive(check.store, ARCHIVE_NAMES[model])
    folder = "resnet_152_batch" if model == RESNET152 else "resnet_50"
    built, _ = _module(f"build_{model}", EXAMPLES / folder / "build_mar.py").build_mar(
        check.store)
    return Path(built)


def _module(name: str, path: Path) -> Any:
    """A module by its path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_archive(store: Path, name: str) -> Path:
    import torch

    from model_archiver.packaging import ArchiveFormat, ArchiveOptions, build_archive

    with tempfile.TemporaryDirectory(prefix="tiny-net-") as tmp:
        model_file = Path(tmp) / "model.py"
        model_file.write_text(TINY_MODEL)
        torch.manual_seed(0)
        weights = Path(tmp) / "tiny.pt"
        torch.save(_module("tiny_net", model_file).TinyNet().state_dict(), weights)
        return Path(build_archive(ArchiveOptions(
            model_name=name, version="1.0", model_file=str(model_file),
            serialized_file=str(weights), handler="image_classifier",
            extra_files=(str(EXAMPLES / "resnet_152_batch" / "index_to_name.json"),),
            export_path=store, archive_format=ArchiveFormat.ZIP_STORE)))


def test_jpegs() -> list[bytes]:
    return [path.read_bytes() for path in TEST_JPEGS]


def imagenet_jpegs(check: Check) -> list[bytes]:
    from benchmarks.jpegs import natural_jpegs

    if check.tiny:
        return natural_jpegs(6, sizes=((160, 120), (120, 160)))
    return natural_jpegs(48)


def properties(check: Check) -> str:
    # The queue holds every client's request (the default, 100, would turn clients away).
    return f"number_of_gpu={1 if check.cuda else 0}\njob_queue_size=1024\n"


# -- one served run ---------------------------------------------------------------------------


def served(check: Check, server: ManagementClient, *, inference: str, register: str,
           name: str, model: str, variant: str, batch: int, workers: int, bodies: list[bytes],
           server_kind: str = BATCHSERVE, kind: str = SATURATION,
           profile: str | None = None) -> dict[str, Any]:
    """Register ``register`` as ``name`` with ``workers`` workers, drive it closed-loop,
    unregister it; its row (recorded, with the error if it failed)."""
    clients = 1 if kind == LONE else min(MAX_CLIENTS, 2 * batch * workers)
    row: dict[str, Any] = {"server": server_kind, "model": model, "variant": variant,
                           "kind": kind, "batch": batch, "workers": workers,
                           "clients": clients}
    label = f"{server_kind} {model} {variant} batch {batch} workers {workers}"
    try:
        server.register(register, model_name=name, batch_size=batch,
                        max_batch_delay=MAX_BATCH_DELAY_MS, initial_workers=workers)
    except Exception as error:
        row["error"] = f"registration failed: {error}"
        print(f"  {label}: {row['error'][:300]}", flush=True)
        return check.record(row)
    try:
        row.update(_measure(check, server, inference, name, bodies, clients, profile))
        print(f"  {label}: {row.pop('summary')}", flush=True)
    except Exception as error:
        row["error"] = repr(error)
        print(f"  {label}: FAILED {error!r}", flush=True)
        traceback.print_exc()
    finally:
        try:
            server.unregister(name)
        except Exception as error:
            print(f"  {label}: could not unregister: {error}", flush=True)
    return check.record(row)


def _measure(check: Check, server: ManagementClient, inference: str, name: str,
             bodies: list[bytes], clients: int, profile: str | None) -> dict[str, Any]:
    described = server.describe(name)
    workers = described.get("workers") or []
    spy = None
    if profile is not None and workers:
        spy = gpu_load.start_profile(int(workers[0]["pid"]),  # type: ignore[index]
                                     gpu_load.start_s(check.processes) + check.warmup_s,
                                     check.duration_s,
                                     check.out / "profile" / f"{profile}.txt")
        if spy is None:
            check.note("no py-spy on PATH: the worker was not profiled")
    with GpuSampler() as gpu:
        load = gpu_load.drive(f"{inference}/predictions/{name}", bodies, clients=clients,
                              duration_s=check.duration_s, warmup_s=check.warmup_s,
                              processes=check.processes)
    memory = gpu_load.gpu_memory_mib()
    if spy is not None:
        spy.wait(timeout=60)
    batches = server.describe(name).get("batching") or {}
    return {"img_s": load.img_s, "p50_ms": load.percentile_ms(50),
            "p99_ms": load.percentile_ms(99), "gpu_busy_pct": gpu.mean,
            "gpu_memory_mib": memory, "statuses": dict(load.statuses),
            "recent_batches": list(batches.get("recentBatchSizes", []))[-8:],  # type: ignore[union-attr]
            "worker": workers[0] if workers else None, "summary": load.summary()}


def summarise_profile(check: Check, label: str) -> None:
    """The profile's summary, printed and kept beside it."""
    from benchmarks.profile_summary import parse_raw, summarise

    path = check.out / "profile" / f"{label}.txt"
    if not path.exists():
        return
    text = summarise(parse_raw(path.read_text()), title=f"worker profile, {label}")
    path.with_suffix(".summary.txt").write_text(text + "\n")
    print(text, flush=True)


# -- the steps --------------------------------------------------------------------------------


def step_resnet152(check: Check) -> None:
    mar = archive(check, RESNET152)
    plan: Plan = ([("bf16", 128, 1), ("bf16", 128, 2), ("fp32", 64, 1), ("fp32", 64, 2),
                   ("bf16-eager", 128, 1)] if check.cuda
                  else [("bf16", 4, 1)])  # fp32's run is the same code
    names = {variant: model_folder(check.store, mar, variant)
             for variant in {"fp32", *(variant for variant, _, _ in plan)}}
    bodies = test_jpegs()
    with check.batchserve() as server:
        if check.affords("lone client"):
            served(check, server, inference=server.inference, register=names["fp32"],
                   name="lone", model=RESNET152, variant="fp32", batch=1, workers=1,
                   bodies=bodies, kind=LONE)
        for variant, batch, workers in plan:
            label = f"resnet152-{variant}-b{batch}-w{workers}"
            if not check.affords(label):
                continue
            profile = label if check.profile and workers == 1 and variant != "fp32" else None
            served(check, server, inference=server.inference, register=names[variant],
                   name=label, model=RESNET152, variant=variant, batch=batch,
                   workers=workers, bodies=bodies, profile=profile)
            if profile is not None:
                summarise_profile(check, profile)


def step_resnet50(check: Check) -> None:
    mar = archive(check, RESNET50)
    plan: Plan = ([("bf16", 128, 2), ("bf16", 64, 2), ("bf16", 128, 1)] if check.cuda
                  else [("bf16", 8, 1)])
    name = model_folder(check.store, mar, "bf16", prefix="resnet50")
    bodies = imagenet_jpegs(check)
    sizes = sorted(len(body) for body in bodies)
    check.note(f"resnet50 JPEGs: {len(bodies)}, {sizes[0] // 1000}-{sizes[-1] // 1000} KB")
    with check.batchserve() as server:
        for variant, batch, workers in plan:
            label = f"resnet50-{variant}-b{batch}-w{workers}"
            if check.affords(label):
                served(check, server, inference=server.inference, register=name, name=label,
                       model=RESNET50, variant=variant, batch=batch, workers=workers,
                       bodies=bodies)


def step_ipc(check: Check) -> None:
    """Workers sharing one copy of the weights through CUDA IPC: the GPU's memory in use and
    the throughput with 1, 2 and 4 workers of one model (scaled up); then, time permitting,
    the same without sharing at 1 and 4 workers."""
    mar = archive(check, RESNET152)
    batch = 32 if check.cuda else 4
    bodies = test_jpegs()
    plan = ((("fp32-ipc", (1, 2, 4)), ("fp32", (1, 4))) if not check.tiny
            else (("fp32-ipc", (1, 2)),))
    for variant, counts in plan:
        if not check.affords(f"{variant} with 1 worker"):
            return
        folder = model_folder(check.store, mar, variant)
        memory: dict[int, float | None] = {}
        with check.batchserve() as server:
            idle = gpu_load.gpu_memory_mib()
            try:
                server.register(folder, model_name="shared", batch_size=batch,
                                max_batch_delay=MAX_BATCH_DELAY_MS, initial_workers=1)
                for workers in counts:
                    if workers > 1:
                        if not check.affords(f"{variant} with {workers} workers"):
                            break
                        server.scale("shared", workers)
                    memory[workers] = _ipc_point(check, server, variant, batch, workers,
                                                 bodies)
            except Exception as error:
                check.record({"server": BATCHSERVE, "model": RESNET152, "variant": variant,
                              "kind": "ipc", "batch": batch, "error": repr(error)})
                print(f"  {variant}: FAILED {error!r}", flush=True)
        extra = gpu_load.per_extra_worker(memory)
        text = (f"{variant}: GPU memory in use {_mib(idle)} with the server idle, "
                + ", ".join(f"{count} workers {_mib(mib)}" for count, mib in memory.items())
                + (f": {extra:.0f} MiB per extra worker" if extra is not None else ""))
        print(f"  {text}", flush=True)
        check.note(text)


def _mib(value: float | None) -> str:
    return "na" if value is None else f"{value:.0f} MiB"


def _ipc_point(check: Check, server: Batchserve, variant: str, batch: int, workers: int,
               bodies: list[bytes]) -> float | None:
    """One point of the sharing run: its throughput, then the GPU's memory in use (read
    after the load: every worker has run batches, its caches are full)."""
    row: dict[str, Any] = {"server": BATCHSERVE, "model": RESNET152, "variant": variant,
                           "kind": "ipc", "batch": batch, "workers": workers,
                           "clients": min(MAX_CLIENTS, 2 * batch * workers)}
    row.update(_measure(check, server, server.inference, "shared", bodies, row["clients"],
                        None))
    print(f"  {variant} {workers} workers: {row.pop('summary')}, GPU memory "
          f"{_mib(row['gpu_memory_mib'])}", flush=True)
    check.record(row)
    return row["gpu_memory_mib"]  # type: ignore[no-any-return]


def step_torchserve(check: Check) -> None:
    from benchmarks.torchserve import TorchServe, find_install

    install, origin = (find_install(check.out / "torchserve") if check.torchserve
                       else (None, "not looked for (--no-torchserve)"))
    if install is None:
        print(f"  TorchServe: skipped: {origin}", flush=True)
        check.note(f"TorchServe not measured: {origin}")
        return
    print(f"  TorchServe 0.12: {origin}", flush=True)
    mar = archive(check, RESNET152)
    plan = [(32, 1), (8, 1), (16, 2), (16, 4)] if check.cuda else [(8, 1)]
    bodies = test_jpegs()
    if not check.affords("TorchServe"):
        return
    with TorchServe(check.store, quiet=True, install=install, extra_properties=[
            f"number_of_gpu={1 if check.cuda else 0}", "job_queue_size=1024",
            "default_response_timeout=300"]) as server:
        check.keep_logs(server.work / "logs")
        for batch, workers in plan:
            if check.affords(f"TorchServe batch {batch} workers {workers}"):
                served(check, server, inference=server.inference, register=mar.name,
                       name=f"ts-b{batch}-w{workers}", model=RESNET152, variant="fp32",
                       batch=batch, workers=workers, bodies=bodies, server_kind=TORCHSERVE)


STEPS: dict[str, Callable[[Check], None]] = {
    "resnet152": step_resnet152, "resnet50": step_resnet50, "torchserve": step_torchserve,
    "ipc": step_ipc}


def versions() -> int:
    """Python's, torch's and torchvision's versions, and the GPU torch sees."""
    import torch
    import torchvision

    print(sys.version.split()[0], torch.__version__, torchvision.__version__,
          torch.cuda.is_available() and torch.cuda.get_device_name(0), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=[*STEPS, "all"])
    parser.add_argument("--out", type=Path, required=True, help="results.json, profiles")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (the dry run)")
    parser.add_argument("--tiny", action="store_true", help="small models and JPEGs")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured a run")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of warm-up a run")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds for the step")
    parser.add_argument("--profile", action="store_true", help="py-spy the bf16 worker")
    parser.add_argument("--no-torchserve", dest="torchserve", action="store_false",
                        help="do not look for TorchServe (its row says so)")
    if (sys.argv[1:] if argv is None else argv) == ["versions"]:
        return versions()
    args = parser.parse_args(argv)
    (args.out / "store").mkdir(parents=True, exist_ok=True)
    steps = list(STEPS) if args.step == "all" else [args.step]
    failed = False
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        shared = None
        if args.step == "all":  # one server for every step (the dry run's few seconds)
            first = Check(args.out, args.device, args.tiny)
            shared = stack.enter_context(first.batchserve())
        for index, step in enumerate(steps):
            left = args.budget - (time.monotonic() - started)
            check = Check(args.out, args.device, args.tiny, args.duration, args.warmup,
                          left / (len(steps) - index), args.profile, args.torchserve, shared)
            print(f"== {step} ({check.budget_s:.0f} s budget)", flush=True)
            try:
                STEPS[step](check)
            except Exception as error:  # a step that breaks still leaves its note
                failed = True
                traceback.print_exc()
                check.note(f"{step} failed: {error!r}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
