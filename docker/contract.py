"""What batchserve's images promise, as checks that run two ways.

The image smoke tests (``make image``: docker/build.py for the KServe image,
docker/sagemaker_smoke.py for the SageMaker one) run them against a container. ``make test``
runs the same checks against the server started outside any container, with the layout and
the environment the image gives it (tests/integration/test_image_contract.py). So a change
that breaks an image's contract fails CI, not the next image build.

A check asks what users and operators rely on: the APIs answer with the model's numbers,
describe says what the configuration asked for, the server and its workers are the processes
a runtime expects, SIGTERM ends it with status 0, and the server's log is where and how
TorchServe's log parsers read it. No check reads the wording of a log message.

This module holds what both images share and the KServe image's checks;
docker/sagemaker_contract.py holds the SageMaker image's.
"""

from __future__ import annotations

import json
import re
import shlex
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from model_archiver.packaging import ArchiveOptions, build_archive
from protos import open_inference_pb2 as pb
from protos import open_inference_pb2_grpc as pb_grpc

Check = Callable[[], tuple[bool, str]]
"""A check: (passed, what it saw)."""

STOP_GRACE_S = 60
"""How long a stop waits after SIGTERM before SIGKILL (podman's and Kubernetes' default is
less; the checks ask for an exit well within it)."""


def run_checks(checks: Sequence[tuple[str, Check]]) -> tuple[int, int]:
    """Run each named check, print PASS or FAIL with what it saw; (passed, failed)."""
    passed = failed = 0
    for name, check in checks:
        try:
            ok, detail = check()
        except Exception as exc:  # a check that cannot even ask has failed, and says so
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        passed, failed = passed + ok, failed + (not ok)
        print(f"   {'PASS' if ok else 'FAIL'} {name}: {detail[:300]}", flush=True)
    return passed, failed


def http(method: str, url: str, body: Any = None, *, content_type: str = "application/json",
         timeout: float = 30, raw: bytes | None = None) -> tuple[int, Any]:
    """One HTTP exchange with a JSON body (or ``raw`` bytes as they are): (status, the answer
    decoded as JSON, else text)."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


# ---- the image's recipe ----------------------------------------------------------------------

def instructions(dockerfile: Path, name: str) -> list[str]:
    """The arguments of each ``name`` instruction of a Dockerfile (continuation lines
    joined)."""
    text = dockerfile.read_text().replace("\\\n", " ")
    return [m.group(1).strip() for m in re.finditer(rf"^{name}\s+(.*)$", text, re.MULTILINE)]


def image_env(dockerfile: Path) -> dict[str, str]:
    """The variables the image's ENV sets, but PATH (the image's venv first: outside the
    image the test's own environment is the server's)."""
    env = dict(pair.split("=", 1) for line in instructions(dockerfile, "ENV")
               for pair in shlex.split(line))
    env.pop("PATH", None)
    return env


def image_command(dockerfile: Path) -> list[str]:
    """The image's CMD (its exec form)."""
    command: list[str] = json.loads(instructions(dockerfile, "CMD")[-1])
    return command


# ---- processes -----------------------------------------------------------------------------

#: A shell loop over /proc, one process a line: pid, parent pid, uid, command line (NULs as
#: spaces). Run inside the container (``podman exec ... sh -c``) or on the host alike.
PROCESS_LISTING = ('for p in /proc/[0-9]*; do echo "${p#/proc/}'
                   ' $(cut -d" " -f4 $p/stat) $(stat -c %u $p)'
                   ' $(tr "\\0" " " < $p/cmdline)"; done')
#: A worker's (or the fork server's) command line: ``python -P -m backend.process.<module>``;
#: a forked worker keeps its fork server's.
WORKER_MARK = "-m backend"


@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    uid: int
    command: str


def parse_processes(listing: str) -> list[Process]:
    """PROCESS_LISTING's output. A process that ended during the listing leaves empty fields:
    not counted."""
    found = []
    for line in listing.splitlines():
        fields = line.split(" ", 3)
        if len(fields) == 4 and all(field.isdigit() for field in fields[:3]):
            found.append(Process(int(fields[0]), int(fields[1]), int(fields[2]), fields[3]))
    return found


def subtree(processes: Sequence[Process], root: int) -> list[Process]:
    """``root`` and every process descended from it."""
    children: dict[int, list[Process]] = {}
    for process in processes:
        children.setdefault(process.ppid, []).append(process)
    found = [p for p in processes if p.pid == root]
    pending = [root]
    while pending:
        kids = children.get(pending.pop(), [])
        found += kids
        pending += [kid.pid for kid in kids]
    return found


def runs(process: Process, program: str) -> bool:
    """One of the process's arguments is ``program``, by itself or as a path's last part."""
    return any(arg == program or arg.endswith(f"/{program}") for arg in process.command.split())


def described_workers(management: str, model: str) -> list[int]:
    """The PIDs of a model's workers, as describe (``GET /models/<model>``) tells them."""
    status, body = http("GET", f"{management}/models/{model}")
    if status != 200 or not isinstance(body, list) or not body:
        return []
    return [int(worker["pid"]) for worker in body[0].get("workers", []) if "pid" in worker]


def server_and_workers(processes: Sequence[Process], server: int, uid: int,
                       workers: Sequence[int], *, alone: bool, marker: str = "torchserve"
                       ) -> tuple[bool, str]:
    """The server is process ``server`` and runs ``marker`` (in the KServe image it is PID 1,
    the image's ``torchserve`` in the foreground), the workers that describe names are its
    descendants (through the fork server), and all of them run as ``uid`` (1000 in the
    images). ``alone``: ``processes`` are a container's, so every worker process among them
    (``-m backend...``) must be the server's too."""
    tree = subtree(processes, server)
    head = next((p for p in tree if p.pid == server), None)
    ours = {p.pid for p in tree}
    strays = [p.pid for p in processes if alone and WORKER_MARK in p.command
              and p.pid not in ours]
    missing = [pid for pid in workers if pid not in ours]
    parents = sorted({p.ppid for p in tree if p.pid in workers})
    uids = sorted({p.uid for p in tree})
    ok = (head is not None and runs(head, marker) and bool(workers) and not missing
          and not strays and uids == [uid])
    return ok, ((f"{server}: {head.command.strip()}; " if head else f"no process {server}; ")
                + f"workers {list(workers)} (parents {parents}), {len(missing)} not the "
                + f"server's descendants, {len(strays)} worker processes not its; uids {uids}")


def sigterm_exits_0(stop: Callable[[], int]) -> Check:
    """``stop`` sends SIGTERM (``podman stop``, Kubernetes, SageMaker) and returns the exit
    status: 0, well before the grace ends in SIGKILL (which would be 137)."""
    def check() -> tuple[bool, str]:
        start = time.monotonic()
        code = stop()
        stop_s = time.monotonic() - start
        return code == 0 and stop_s < STOP_GRACE_S, f"status {code} in {stop_s:.1f} s"
    return check


# ---- the server's log ----------------------------------------------------------------------

#: TorchServe's layout of ts_log.log and of its console (its log4j2.xml; the SageMaker
#: toolkit's is the same): what log parsers written for TorchServe read.
TS_LOG_PATTERN = "%d{ISO8601} [%-5p] %t %c - %m%n"
#: That layout as a regular expression for one line.
TS_LOG_LINE = re.compile(r"(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d{3}) "
                         r"\[(?P<level>TRACE|DEBUG|INFO |WARN |ERROR|FATAL)\] "
                         r"(?P<thread>\S+) (?P<logger>\S+) - (?P<message>.*)")


def worker_thread(model: str, version: str = "1.0") -> re.Pattern[str]:
    """TorchServe's name for the thread that reads a worker's stdout or stderr (the model's
    own lines, logger MODEL_LOG): ``W-<port>-<model>_<version>-stdout``."""
    return re.compile(rf"W-\d+-{re.escape(model)}_{re.escape(version)}-std(out|err)")


def server_log(output: Callable[[], str], ts_log: Callable[[], str], model: str,
               timeout_s: float = 10) -> Check:
    """The server's log in TorchServe's layout, every line, in logs/ts_log.log, the model's
    worker lines among them, and all of it on the console (``output``): the container's log,
    which SageMaker sends to CloudWatch. The console is read after the file, so a line
    written to both at once may show in the file first: asked again until ``timeout_s``."""
    thread = worker_thread(model)

    def check() -> tuple[bool, str]:
        deadline = time.monotonic() + timeout_s
        while True:
            logged = ts_log().splitlines()
            console = set(output().splitlines())
            unparsed = [line for line in logged if not TS_LOG_LINE.fullmatch(line)]
            matches = [m for line in logged if (m := TS_LOG_LINE.fullmatch(line))]
            model_lines = [m for m in matches
                           if m["logger"] == "MODEL_LOG" and thread.fullmatch(m["thread"])]
            missing = [line for line in logged if line not in console]
            ok = bool(logged) and not unparsed and bool(model_lines) and not missing
            if ok or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return ok, (f"ts_log.log {len(logged)} lines, {len(unparsed)} not in TorchServe's "
                    f"layout {unparsed[:1]}, {len(model_lines)} from {thread.pattern}, "
                    f"{len(missing)} not on the console {missing[:1]}")
    return check


# ---- the KServe image ----------------------------------------------------------------------

# KServe's documented config.properties for TorchServe (its torchserve docs), with the model
# the smoke test serves, token authorization off (KServe does not send TorchServe's keys) and
# the ports and bind host as given. {snapshot} is the model_snapshot JSON.
KSERVE_CONFIG = """\
inference_address=http://{bind}:{port}
management_address=http://{bind}:{port}
metrics_address=http://{bind}:{metrics_port}
grpc_inference_port={grpc_port}
grpc_management_port={grpc_management_port}
enable_metrics_api=true
metrics_format=prometheus
number_of_netty_threads=4
job_queue_size=10
enable_envvars_config=true
install_py_dep_per_model=true
disable_token_authorization=true
model_store=/mnt/models/model-store
model_snapshot={snapshot}
"""
SMOKE_MODEL = "affine"
SMOKE_HANDLER = Path(__file__).resolve().parent / "smoke_handler.py"
SMOKE_MODEL_CONFIG = """\
inputs:
  - {name: INPUT0, datatype: FP32, shape: [-1, 4]}
outputs:
  - {name: OUTPUT0, datatype: FP32, shape: [-1, 4]}
"""
# KServe's kserve-torchserve ServingRuntime runs the image with these args, which replace its
# CMD (the same line with --foreground), and with the envelope its controller picks for the
# InferenceService's protocol in TS_SERVICE_ENVELOPE, the protocol in PROTOCOL_VERSION.
KSERVE_ARGS = ("torchserve", "--start", "--model-store=/mnt/models/model-store",
               "--ts-config=/mnt/models/config/config.properties")
KSERVE_ENVELOPES = {"v1": "kserve", "v2": "kservev2", "grpc-v2": "kservev2"}


def kserve_env(protocol: str | None) -> dict[str, str]:
    """What KServe's runtime adds to the environment for ``protocol`` (none: the CMD)."""
    if protocol is None:
        return {}
    return {"TS_SERVICE_ENVELOPE": KSERVE_ENVELOPES[protocol], "PROTOCOL_VERSION": protocol}


@dataclass(frozen=True)
class Ports:
    port: int
    """inference and management (KServe's config: 8085)"""
    metrics_port: int
    grpc_port: int
    grpc_management_port: int


def kserve_layout(root: Path, bind: str, ports: Ports) -> None:
    """KServe's storage layout: <root>/model-store/affine.mar (docker/smoke_handler.py, built
    by our model-archiver) and <root>/config/config.properties, readable by the image's
    uid 1000."""
    store, config = root / "model-store", root / "config"
    store.mkdir()
    config.mkdir()
    model_config = root / "model-config.yaml"
    model_config.write_text(SMOKE_MODEL_CONFIG)
    build_archive(ArchiveOptions(model_name=SMOKE_MODEL, handler=str(SMOKE_HANDLER),
                                 config_file=str(model_config), export_path=store, force=True))
    model_config.unlink()
    snapshot = {"name": "startup.cfg", "modelCount": 1, "models": {SMOKE_MODEL: {"1.0": {
        "defaultVersion": True, "marName": f"{SMOKE_MODEL}.mar", "minWorkers": 1,
        "maxWorkers": 1, "batchSize": 4, "maxBatchDelay": 10, "responseTimeout": 120}}}}
    (config / "config.properties").write_text(KSERVE_CONFIG.format(
        bind=bind, port=ports.port, metrics_port=ports.metrics_port, grpc_port=ports.grpc_port,
        grpc_management_port=ports.grpc_management_port,
        snapshot=json.dumps(snapshot, separators=(",", ":"))))
    for path in (root, *root.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)


EXPECTED = [[3.0, 5.0, 7.0, 9.0], [1.0, 1.0, 1.0, 1.0]]  # 2 * x + 1 of the inputs below
INPUTS = [[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]]
FLAT_INPUTS = [x for row in INPUTS for x in row]
FLAT_EXPECTED = [x for row in EXPECTED for x in row]
V2_REQUEST = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2, 4],
                          "data": FLAT_INPUTS}]}


def numbers(body: Any) -> list[float] | None:
    """The numbers an answer carries, flattened: a bare list (/predictions), KServe v1's
    ``predictions`` or Open Inference's ``outputs[].data``; None for anything else. Under
    TorchServe's envelopes the tensors' names and shapes differ (its kservev2 envelope names an
    output after its input, flat): KServe mode's own tests check those; this checks the sums."""
    if isinstance(body, dict) and "predictions" in body:
        body = body["predictions"]
    elif isinstance(body, dict) and isinstance(body.get("outputs"), list):
        body = [output.get("data") for output in body["outputs"] if isinstance(output, dict)]
    flat: list[float] = []
    pending = [body]
    while pending:
        value = pending.pop()
        if isinstance(value, list):
            pending.extend(reversed(value))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat.append(float(value))
        else:
            return None
    return flat


def tensor_values(tensor: Any, raw: bytes | None) -> list[float]:
    """An Open Inference output tensor's values, from its typed contents or raw bytes."""
    kind = {"FP32": ("fp32_contents", "f"), "FP64": ("fp64_contents", "d")}.get(tensor.datatype)
    if kind is None:
        return []
    field, code = kind
    if raw:
        return [float(x) for x in struct.unpack(f"<{len(raw) // struct.calcsize(code)}{code}",
                                                raw)]
    return [float(x) for x in getattr(tensor.contents, field)]


def grpc_checks(port: int, *, strict: bool) -> tuple[bool, str]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        live = stub.ServerLive(pb.ServerLiveRequest(), timeout=30).live
        ready = stub.ModelReady(pb.ModelReadyRequest(name=SMOKE_MODEL), timeout=30).ready
        request = pb.ModelInferRequest(model_name=SMOKE_MODEL)
        tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[2, 4])
        tensor.contents.fp32_contents.extend(FLAT_INPUTS)
        response = stub.ModelInfer(request, timeout=30)
    output = response.outputs[0]
    raw = response.raw_output_contents[0] if response.raw_output_contents else None
    values = tensor_values(output, raw)
    ok = live and ready and values == FLAT_EXPECTED
    if strict:
        ok = ok and output.name == "OUTPUT0" and list(output.shape) == [2, 4]
    return ok, (f"live={live} ready={ready} {output.name} {output.datatype}"
                f"{list(output.shape)}={values}")


@dataclass(frozen=True)
class KServeEndpoints:
    """Where a server on kserve_layout's config answers: TorchServe's REST (the config's
    inference port), KServe's REST and gRPC (the config's ports, or KServe's own with a
    protocol), metrics."""

    inference: str
    kserve_rest: str
    kserve_grpc_port: int
    metrics: str
    protocol: str | None
    """How KServe's runtime started it (v1, v2, grpc-v2: through TorchServe's envelope), or
    None (the image's CMD)."""


def kserve_checks(at: KServeEndpoints) -> list[tuple[str, Check]]:
    """What to check, by how the server was started: without a KServe protocol, every API
    with TorchServe's and the protocols' own bodies; with one, what KServe sends for it."""
    model = SMOKE_MODEL
    envelope = KSERVE_ENVELOPES.get(at.protocol or "")

    def ping() -> tuple[bool, str]:
        status, body = http("GET", f"{at.inference}/ping")
        return status == 200 and body == {"status": "Healthy"}, f"{status} {body}"

    def predictions() -> tuple[bool, str]:
        # An envelope reads /predictions bodies as its protocol's requests.
        request: Any = {"kserve": {"instances": INPUTS}, "kservev2": V2_REQUEST}.get(
            envelope or "", INPUTS[0])
        expected = EXPECTED[0] if envelope is None else FLAT_EXPECTED
        status, body = http("POST", f"{at.inference}/predictions/{model}", request)
        return status == 200 and numbers(body) == expected, f"{status} {body}"

    def v1_ready() -> tuple[bool, str]:
        status, body = http("GET", f"{at.kserve_rest}/v1/models/{model}")
        return status == 200 and isinstance(body, dict) and body.get("ready") is True, \
            f"{status} {body}"

    def v1_predict() -> tuple[bool, str]:
        status, body = http("POST", f"{at.kserve_rest}/v1/models/{model}:predict",
                            {"instances": INPUTS})
        ok = status == 200 and isinstance(body, dict) and numbers(body) == FLAT_EXPECTED
        return ok, f"{status} {body}"

    def v2_ready() -> tuple[bool, str]:
        status, body = http("GET", f"{at.kserve_rest}/v2/health/ready")
        model_status, _ = http("GET", f"{at.kserve_rest}/v2/models/{model}/ready")
        ok = status == 200 and body == {"ready": True} and model_status == 200
        return ok, f"server {status} {body}, model {model_status}"

    def v2_infer() -> tuple[bool, str]:
        status, body = http("POST", f"{at.kserve_rest}/v2/models/{model}/infer", V2_REQUEST)
        ok = status == 200 and numbers(body) == FLAT_EXPECTED
        if envelope is None:  # batchserve's own v2: the tensor as model-config.yaml declares
            ok = ok and body["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32",
                                             "shape": [2, 4], "data": FLAT_EXPECTED}]
        return ok, f"{status} {body}"

    def grpc_v2() -> tuple[bool, str]:
        return grpc_checks(at.kserve_grpc_port, strict=envelope is None)

    def metrics() -> tuple[bool, str]:
        with urllib.request.urlopen(f"{at.metrics}/metrics", timeout=30) as response:
            text = response.read().decode()
        return response.status == 200 and "ts_inference_requests_total" in text, \
            f"{response.status}, {len(text)} bytes"

    v1 = [("KServe v1 model ready", v1_ready), ("KServe v1 :predict", v1_predict)]
    v2 = [("KServe v2 ready", v2_ready), ("KServe v2 /infer", v2_infer),
          ("Open Inference gRPC (live, ready, ModelInfer)", grpc_v2)]
    protocols = {None: v1 + v2, "v1": v1, "v2": v2, "grpc-v2": v2}[at.protocol]
    return [("TorchServe /ping", ping), ("TorchServe /predictions", predictions), *protocols,
            ("metrics", metrics)]


def kserve_ready_url(at: KServeEndpoints) -> str:
    """Ready as KServe sees it: the model's readiness on the protocol it speaks."""
    return at.kserve_rest + (f"/v1/models/{SMOKE_MODEL}" if at.protocol == "v1"
                             else f"/v2/models/{SMOKE_MODEL}/ready")
