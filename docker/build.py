"""Build batchserve's container image on this machine and smoke-test it: ``make image``.

Opt-in and slow (torch goes into the image), never part of ``make test``. Needs root and
Debian's mmdebstrap, podman and runc (``make image`` installs them with apt when missing).

1. **base**: Debian bookworm (minbase, python3, python3-venv) made by mmdebstrap from the
   package mirror and imported into podman, since no registry image can be pulled here. Kept
   between runs (``--rebuild-base`` makes it again).
2. **wheels**: batchserve's wheel and every wheel it needs, resolved on this host by pip as it
   is configured here, into build/image/<variant>/wheels: the build context.
3. **image**: ``podman build`` of docker/Dockerfile with that base; it installs the wheels
   offline.
4. **smoke**: the image run on KServe's storage layout: /mnt/models (read-only) holds
   model-store/ with a small torch model built by our model-archiver (docker/smoke_handler.py)
   and config/config.properties after KServe's documented one; host network. TorchServe's /ping
   and /predictions, KServe v1 and v2 REST and Open Inference gRPC must answer on 127.0.0.1,
   PID 1 must be the server as uid 1000 with its workers its descendants, and SIGTERM must
   stop it with exit status 0. By default the container runs its CMD; ``--kserve
   v1|v2|grpc-v2`` runs it exactly as KServe's runtime does for that protocol (its args and
   env; REST on 8080, gRPC on 8081). The checks are docker/contract.py's, which ``make test``
   also runs against the server outside any container.

``--variant sagemaker`` builds docker/Dockerfile.sagemaker instead: the SageMaker PyTorch
inference toolkit beside batchserve (CPU torch), started as SageMaker starts a container
(``IMAGE serve``); docker/sagemaker_smoke.py is its smoke test (single model and multi-model).
``--variant vertex`` builds docker/Dockerfile.vertex: Vertex AI's prebuilt PyTorch image's
contract (CPU torch, google-cloud-storage), run with Vertex's AIP_* environment and the model
mounted as its storage; docker/vertex_smoke.py is its smoke test.

Usage: python -m docker.build [--variant cpu|cuda|sagemaker] [--no-smoke | --smoke-only]
[--kserve P]; --help tells the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement

from docker.contract import (
    KSERVE_ARGS,
    KSERVE_ENVELOPES,
    PROCESS_LISTING,
    SMOKE_MODEL,
    STOP_GRACE_S,
    KServeEndpoints,
    Ports,
    Process,
    described_workers,
    http,
    kserve_checks,
    kserve_env,
    kserve_layout,
    kserve_ready_url,
    parse_processes,
    run_checks,
    server_and_workers,
    sigterm_exits_0,
)
from frontend import __version__

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "image"
LOG = WORK / "build.log"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
SAGEMAKER_DOCKERFILE = ROOT / "docker" / "Dockerfile.sagemaker"
SAGEMAKER_ENTRYPOINT = ROOT / "docker" / "sagemaker-entrypoint.sh"
VERTEX_DOCKERFILE = ROOT / "docker" / "Dockerfile.vertex"

BASE_IMAGE = "localhost/batchserve-base:bookworm"
SUITE = "bookworm"  # its python3 is 3.11, as this host's: the wheels built here fit it
BASE_PACKAGES = ("python3", "python3-venv")  # python3-venv brings pip for the image's venv
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Documentation, manual pages and translations: nobody reads them in a server image.
DPKG_EXCLUDES = ("path-exclude=/usr/share/man/*", "path-exclude=/usr/share/doc/*",
                 "path-include=/usr/share/doc/*/copyright", "path-exclude=/usr/share/locale/*")


@dataclass(frozen=True)
class Variant:
    torch: str
    torchvision: str | None
    """None: the image has no torchvision (the built-in image handlers cannot load)."""
    dockerfile: Path = DOCKERFILE
    requirements: tuple[str, ...] = ()
    """What the image holds beside batchserve, torch and the extras."""
    files: tuple[Path, ...] = ()
    """Put in the build context beside wheels/, for the Dockerfile's COPY."""


# The SageMaker PyTorch inference toolkit (its `serve` and handler service, with
# sagemaker-inference bundled). It reads its files through pkg_resources, which setuptools 82
# no longer has.
SAGEMAKER_REQUIREMENTS = ("sagemaker-pytorch-inference>=2.0.25,<2.1", "setuptools<82")

VARIANTS = {
    # The CPU build of torch that this machine's pip has on disk. torchvision's CPU wheels come
    # only from PyTorch's own index, which is not reachable here, and PyPI's torchvision needs
    # CUDA torch; elsewhere pass --torch/--torchvision with their +cpu builds and
    # --pip-arg=--extra-index-url=<PyTorch's CPU index>.
    "cpu": Variant(torch="torch==2.13.0+cpu", torchvision=None),
    # PyPI's torch is the CUDA build; its CUDA libraries come as nvidia-* wheels (~5.5 GB).
    "cuda": Variant(torch="torch==2.14.1", torchvision="torchvision==0.29.1"),
    # SageMaker's serving container (docker/Dockerfile.sagemaker): the CPU variant's torch with
    # the toolkit; --torch/--torchvision make a GPU one as they do for cpu.
    "sagemaker": Variant(torch="torch==2.13.0+cpu", torchvision=None,
                         dockerfile=SAGEMAKER_DOCKERFILE, requirements=SAGEMAKER_REQUIREMENTS,
                         files=(SAGEMAKER_ENTRYPOINT,)),
    # Vertex AI's prebuilt PyTorch image's stand-in (docker/Dockerfile.vertex): the CPU
    # variant's torch with google-cloud-storage (batchserve's vertex extra, for gs:// URIs).
    "vertex": Variant(torch="torch==2.13.0+cpu", torchvision=None,
                      dockerfile=VERTEX_DOCKERFILE,
                      requirements=("google-cloud-storage>=2.10,<4",)),
}
# torch's tensor/numpy bridge and most handlers use numpy; torch leaves it optional and, without
# torchvision, nothing else brings it.
EXTRA_REQUIREMENTS = ("numpy",)

# KServe's runtime sends REST to 8080 and grpc-v2 to 8081 (its args and env: docker/contract.py).
KSERVE_REST_PORT = 8080
KSERVE_GRPC_PORT = 8081
SMOKE_CONTAINER = "batchserve-image-smoke"
UID = 1000  # the image's USER

MMDEBSTRAP_TIMEOUT_S = 1200
PIP_TIMEOUT_S = 1800
BUILD_TIMEOUT_S = 3600


class BuildError(Exception):
    """A step failed; the message says which and why (build/image/build.log has the rest)."""


# ---- running commands ------------------------------------------------------------------

def run(cmd: Sequence[str], *, timeout: float, capture: bool = False) -> str:
    """Run a command, its output appended to the log (or returned when ``capture``)."""
    with LOG.open("a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        try:
            done = subprocess.run(
                list(cmd), stdin=subprocess.DEVNULL, timeout=timeout, text=True, errors="replace",
                stdout=subprocess.PIPE if capture else log, stderr=log)
        except subprocess.TimeoutExpired as exc:
            raise BuildError(f"{cmd[0]} ran past {timeout:.0f} s: {' '.join(cmd)}") from exc
    if done.returncode != 0:
        raise BuildError(f"{' '.join(cmd[:3])} ... exited {done.returncode}; "
                         f"the end of {LOG}:\n{_tail(LOG)}")
    return done.stdout or ""


def _tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def podman(*args: str, timeout: float = 120, capture: bool = True) -> str:
    # runc, not crun: this machine mounts cgroups v1 and v2 together ("hybrid"), which crun
    # refuses.
    return run(("podman", "--runtime", "runc", *args), timeout=timeout, capture=capture)


def ulimits() -> list[str]:
    """Limits at or below this process's hard limits: root here lacks CAP_SYS_RESOURCE, and
    podman's defaults (1048576 open files) are above them, so a container would not start."""
    flags = []
    for name, limit, cap in (("nofile", resource.RLIMIT_NOFILE, 65536),
                             ("nproc", resource.RLIMIT_NPROC, 32768)):
        hard = resource.getrlimit(limit)[1]
        value = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
        flags += ["--ulimit", f"{name}={value}:{value}"]
    return flags


def image_id(tag: str) -> str | None:
    found = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", tag],
                           capture_output=True, text=True)
    return found.stdout.strip() if found.returncode == 0 else None


def drop_replaced(previous: str | None, tag: str) -> None:
    """Remove the image a rebuild took ``tag`` from: untagged, it would only hold disk."""
    if previous is not None and previous != image_id(tag):
        subprocess.run(["podman", "rmi", previous], capture_output=True)


@contextmanager
def step(name: str, timings: dict[str, float]) -> Iterator[None]:
    print(f"== {name} ...", flush=True)
    start = time.monotonic()
    yield
    timings[name] = time.monotonic() - start
    print(f"== {name}: {timings[name]:.1f} s", flush=True)


# ---- 1. base ---------------------------------------------------------------------------

def build_base(mirrors: Sequence[str], rebuild: bool) -> None:
    exists = subprocess.run(["podman", "image", "exists", BASE_IMAGE]).returncode == 0
    if exists and not rebuild:
        print(f"   {BASE_IMAGE} is there (--rebuild-base makes it again)")
    else:
        previous = image_id(BASE_IMAGE)
        tarball = WORK / f"base-{SUITE}.tar"
        # No mirror given: mmdebstrap's default, with the suite's updates and security added.
        run(["mmdebstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
             *(f"--dpkgopt={option}" for option in DPKG_EXCLUDES),
             SUITE, str(tarball), *mirrors], timeout=MMDEBSTRAP_TIMEOUT_S)
        podman("import", "--change", f"ENV PATH={BASE_PATH}", "--change", 'CMD ["/bin/bash"]',
               str(tarball), BASE_IMAGE, timeout=600)
        tarball.unlink()
        drop_replaced(previous, BASE_IMAGE)
    # The wheels are built by this interpreter; pip in the image takes them only if it is the
    # same Python minor version.
    image_python = podman("run", "--rm", "--network", "host", *ulimits(), BASE_IMAGE,
                          "python3", "-c", "import sys; print(*sys.version_info[:2])").split()
    host_python = [str(part) for part in sys.version_info[:2]]
    if image_python != host_python:
        raise BuildError(f"the base's Python is {'.'.join(image_python)}, this one is "
                         f"{'.'.join(host_python)}: run the build with a Python "
                         f"{'.'.join(image_python)}")


# ---- 2. wheels -------------------------------------------------------------------------

def requirements(wheel: Path, variant: Variant, extras: Sequence[str]) -> list[str]:
    """batchserve's own requirements (no extras), torch and torchvision pinned as the variant
    says (torchvision dropped when it has none), the variant's own requirements and the extra
    packages."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode())
    pinned = {"torch": variant.torch, "torchvision": variant.torchvision}
    result = []
    for line in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        if requirement.marker is not None and "extra" in str(requirement.marker):
            continue
        if requirement.name in pinned:
            spec = pinned[requirement.name]
            if spec is not None:
                result.append(spec)
            continue
        result.append(line)
    return [*result, *variant.requirements, *extras]


def source_tree(target: Path) -> Path:
    """The working tree as git sees it (tracked and new files, not ignored ones), copied: a
    wheel built in place would also take whatever stale modules setuptools' build/ holds."""
    listed = run(["git", "-C", str(ROOT), "ls-files", "--cached", "--others",
                  "--exclude-standard", "-z"], timeout=60, capture=True)
    for name in filter(None, listed.split("\0")):
        path = ROOT / name
        if path.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target / name)
    return target


def build_wheels(variant: Variant, context: Path, extras: Sequence[str],
                 pip_args: Sequence[str]) -> list[Path]:
    wheels = context / "wheels"
    shutil.rmtree(context, ignore_errors=True)
    wheels.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check", "--no-cache-dir",
           "--wheel-dir", str(wheels), *pip_args]
    source = WORK / "src"
    shutil.rmtree(source, ignore_errors=True)
    run([*pip, "--no-deps", str(source_tree(source))], timeout=PIP_TIMEOUT_S)
    shutil.rmtree(source)
    own = next(wheels.glob("batchserve-*.whl"))
    run([*pip, *requirements(own, variant, extras)], timeout=PIP_TIMEOUT_S)
    for path in variant.files:
        shutil.copy2(path, context / path.name)
    return sorted(wheels.glob("*.whl"))


# ---- 3. image --------------------------------------------------------------------------

def build_image(tag: str, name: str, variant: Variant, context: Path) -> None:
    previous = image_id(tag)
    # --layers=false: no cached intermediate images (the install stage alone is the size of
    # the image) are left behind.
    podman("build", "--layers=false", "--network", "host", *ulimits(),
           "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "--build-arg", f"VARIANT={name}",
           "--file", str(variant.dockerfile), "--tag", tag, str(context),
           timeout=BUILD_TIMEOUT_S, capture=False)
    drop_replaced(previous, tag)


def image_size(tag: str) -> int:
    return int(podman("image", "inspect", "--format", "{{.Size}}", tag).strip())


# ---- 4. smoke test ---------------------------------------------------------------------

@dataclass(frozen=True)
class SmokeOptions:
    tag: str
    port: int
    metrics_port: int
    grpc_port: int
    kserve_rest_port: int
    kserve_grpc_port: int
    bind: str
    env: tuple[str, ...]
    kserve_args: bool
    start_timeout_s: float
    protocol: str | None
    """Run as KServe does for this protocol (v1, v2, grpc-v2): through its envelope."""


def port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def container_running(container: str = SMOKE_CONTAINER) -> bool:
    out = subprocess.run(["podman", "inspect", "--format", "{{.State.Running}}",
                          container], capture_output=True, text=True).stdout
    return out.strip() == "true"


def wait_until(ready: Callable[[], bool], timeout_s: float, what: str,
               container: str = SMOKE_CONTAINER) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not container_running(container):
            raise BuildError(f"the container exited while waiting for {what}")
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise BuildError(f"no {what} within {timeout_s:.0f} s")


def container_processes(container: str) -> list[Process]:
    """The container's processes (docker/contract.py's listing, run in it)."""
    return parse_processes(podman("exec", container, "sh", "-c", PROCESS_LISTING))


def endpoints(options: SmokeOptions) -> KServeEndpoints:
    return KServeEndpoints(
        inference=f"http://127.0.0.1:{options.port}",
        kserve_rest=f"http://127.0.0.1:{options.kserve_rest_port}",
        kserve_grpc_port=options.kserve_grpc_port,
        metrics=f"http://127.0.0.1:{options.metrics_port}", protocol=options.protocol)


def pid1_is_the_server(options: SmokeOptions) -> tuple[bool, str]:
    """The server itself is PID 1, as uid 1000, and its workers are its descendants (through
    the fork server). (`torchserve --start` that went to the background would be PID 1 only
    until the server it spawned answers, and the container would end with it.)"""
    return server_and_workers(container_processes(SMOKE_CONTAINER), 1, UID,
                              described_workers(f"http://127.0.0.1:{options.port}", SMOKE_MODEL),
                              alone=True)


def stop_container() -> int:
    """``podman stop``: SIGTERM to PID 1; the container's exit status."""
    if not container_running():
        return -1  # it had ended before SIGTERM
    podman("stop", "--time", str(STOP_GRACE_S), SMOKE_CONTAINER, timeout=STOP_GRACE_S + 60)
    return int(podman("inspect", "--format", "{{.State.ExitCode}}", SMOKE_CONTAINER).strip())


def smoke(options: SmokeOptions) -> tuple[int, int]:
    """Start the container, run the checks, stop it with SIGTERM: (passed, failed)."""
    busy = [port for port in {options.port, options.metrics_port, options.grpc_port,
                              options.grpc_port + 1, options.kserve_rest_port,
                              options.kserve_grpc_port} if port_in_use(port)]
    if busy:
        raise BuildError(f"ports {sorted(busy)} are in use on 127.0.0.1 (the container runs "
                         "on the host network): free them or pass other ports")
    subprocess.run(["podman", "rm", "--force", SMOKE_CONTAINER], capture_output=True)
    layout = Path(tempfile.mkdtemp(prefix="batchserve-image-smoke-"))
    passed = failed = 0
    try:
        kserve_layout(layout, options.bind, Ports(
            port=options.port, metrics_port=options.metrics_port, grpc_port=options.grpc_port,
            grpc_management_port=options.grpc_port + 1))
        env = [*options.env, *(f"{key}={value}" for key, value in
                               kserve_env(options.protocol).items())]
        args = KSERVE_ARGS if options.kserve_args or options.protocol else ()
        podman("run", "--detach", "--name", SMOKE_CONTAINER, "--network", "host", *ulimits(),
               "--volume", f"{layout}:/mnt/models:ro",
               *(flag for pair in env for flag in ("--env", pair)), options.tag, *args)
        print(f"   started: {' '.join(env) or '(no env)'} {' '.join(args) or '(its CMD)'}")
        at = endpoints(options)
        ready_url = kserve_ready_url(at)
        wait_until(lambda: http("GET", ready_url, timeout=5)[0] == 200,
                   options.start_timeout_s, f"{ready_url} answering 200")
        passed, failed = run_checks([
            *kserve_checks(at),
            ("PID 1 is the server, as uid 1000; its workers its descendants",
             lambda: pid1_is_the_server(options)),
            ("SIGTERM drains and exits 0", sigterm_exits_0(stop_container))])
    finally:
        logs = subprocess.run(["podman", "logs", SMOKE_CONTAINER], capture_output=True,
                              text=True)
        (WORK / "smoke-container.log").write_text(logs.stdout + logs.stderr)
        subprocess.run(["podman", "rm", "--force", SMOKE_CONTAINER], capture_output=True)
        shutil.rmtree(layout, ignore_errors=True)
    return passed, failed


# ---- command line ----------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m docker.build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="cpu",
                        help="cpu, cuda: the KServe image with that torch; sagemaker: the "
                        "SageMaker image (CPU torch unless --torch says otherwise)")
    parser.add_argument("--tag", help="image tag (default localhost/batchserve:<version>-"
                        "<variant>)")
    parser.add_argument("--torch", help="torch requirement (default: the variant's)")
    parser.add_argument("--torchvision", help="torchvision requirement, or 'none' (default: "
                        "the variant's)")
    parser.add_argument("--extra", action="append", help="another requirement to put in the "
                        f"image (default: {', '.join(EXTRA_REQUIREMENTS)})")
    parser.add_argument("--pip-arg", action="append", default=[],
                        help="passed to pip wheel (e.g. --pip-arg=--extra-index-url=URL)")
    parser.add_argument("--mirror", action="append", default=[],
                        help="passed to mmdebstrap (default: its own, plus updates/security)")
    parser.add_argument("--rebuild-base", action="store_true")
    stages = parser.add_mutually_exclusive_group()
    stages.add_argument("--no-smoke", action="store_true", help="build only")
    stages.add_argument("--smoke-only", action="store_true", help="smoke-test the built tag")
    parser.add_argument("--port", type=int, default=8085,
                        help="the config's inference/management port (KServe's: 8085)")
    parser.add_argument("--metrics-port", type=int, default=8082)
    parser.add_argument("--grpc-port", type=int, default=7070,
                        help="the config's grpc_inference_port (management is the next one)")
    parser.add_argument("--kserve", choices=sorted(KSERVE_ENVELOPES), dest="protocol",
                        help="run as KServe's runtime does for this protocol: its args, "
                        "TS_SERVICE_ENVELOPE and PROTOCOL_VERSION; REST checked on "
                        f"{KSERVE_REST_PORT}, gRPC on {KSERVE_GRPC_PORT}")
    parser.add_argument("--kserve-rest-port", type=int,
                        help="where v1/v2 REST are checked (default: with --kserve "
                        f"{KSERVE_REST_PORT}, else --port)")
    parser.add_argument("--kserve-grpc-port", type=int,
                        help="where Open Inference gRPC is checked (default: with --kserve "
                        f"{KSERVE_GRPC_PORT}, else --grpc-port)")
    parser.add_argument("--env", action="append", default=[],
                        help="KEY=VALUE for the container (each container, for sagemaker)")
    parser.add_argument("--kserve-args", action="store_true",
                        help="run with KServe's args (no --foreground) instead of the CMD")
    parser.add_argument("--bind", default="127.0.0.1",
                        help="the config's bind host: host network here, so loopback; a pod "
                        "binds 0.0.0.0")
    parser.add_argument("--start-timeout", type=float, default=180.0,
                        help="seconds the server may take to answer /ping")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    default = VARIANTS[args.variant]
    torchvision = args.torchvision or default.torchvision
    variant = dataclasses.replace(default, torch=args.torch or default.torch,
                                  torchvision=None if torchvision == "none" else torchvision)
    sagemaker = variant.dockerfile == SAGEMAKER_DOCKERFILE
    if sagemaker and (args.protocol or args.kserve_args):
        print("--kserve and --kserve-args are for the KServe image, not --variant sagemaker",
              file=sys.stderr)
        return 2
    tag = args.tag or f"localhost/batchserve:{__version__}-{args.variant}"
    missing = [tool for tool in ("mmdebstrap", "podman", "runc") if shutil.which(tool) is None]
    if missing:
        print(f"missing: {' '.join(missing)} (apt-get install mmdebstrap podman runc)",
              file=sys.stderr)
        return 2
    WORK.mkdir(parents=True, exist_ok=True)
    LOG.write_text("")
    timings: dict[str, float] = {}
    started = time.monotonic()
    try:
        if not args.smoke_only:
            with step("base", timings):
                build_base(args.mirror, args.rebuild_base)
            with step("wheels", timings):
                context = WORK / args.variant
                wheels = build_wheels(variant, context, args.extra or EXTRA_REQUIREMENTS,
                                      args.pip_arg)
                print(f"   {len(wheels)} wheels, {sum(w.stat().st_size for w in wheels) >> 20}"
                      f" MiB: {', '.join(w.name.split('-')[0] for w in wheels)}")
                if variant.torchvision is None:
                    print("   no torchvision: the built-in image handlers cannot load")
            with step("image", timings):
                build_image(tag, args.variant, variant, context)
            shutil.rmtree(context)
        print(f"   {tag}: {image_size(tag) / 1e6:.0f} MB")
        if not args.no_smoke:
            with step("smoke", timings):
                if sagemaker:
                    # Imported here: it takes its podman helpers from this module.
                    from docker import sagemaker_smoke
                    passed, failed = sagemaker_smoke.smoke(tag, args.start_timeout,
                                                           tuple(args.env))
                elif variant.dockerfile == VERTEX_DOCKERFILE:
                    from docker import vertex_smoke
                    passed, failed = vertex_smoke.smoke(tag, args.start_timeout,
                                                        tuple(args.env))
                else:
                    passed, failed = smoke(SmokeOptions(
                        tag=tag, port=args.port, metrics_port=args.metrics_port,
                        grpc_port=args.grpc_port,
                        kserve_rest_port=args.kserve_rest_port or (
                            KSERVE_REST_PORT if args.protocol else args.port),
                        kserve_grpc_port=args.kserve_grpc_port or (
                            KSERVE_GRPC_PORT if args.protocol else args.grpc_port),
                        bind=args.bind, env=tuple(args.env), kserve_args=args.kserve_args,
                        start_timeout_s=args.start_timeout, protocol=args.protocol))
            print(f"{passed} passed, {failed} failed")
            if failed:
                logs = ("sagemaker-*.log" if sagemaker else "vertex-container.log"
                        if variant.dockerfile == VERTEX_DOCKERFILE else "smoke-container.log")
                print(f"(the container's log: {WORK / logs})")
                return 1
    except BuildError as exc:
        print(f"failed: {exc}\n(logs: {LOG}, {WORK / 'smoke-container.log'})", file=sys.stderr)
        return 1
    finally:
        print(f"== total {time.monotonic() - started:.1f} s ("
              + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in timings.items()) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
