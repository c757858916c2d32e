"""TorchServe 0.12 for comparisons: its own venv, archiver, config, start, register and stop.

The venv is ``.venv-torchserve`` at the repository's root (made on first use; it holds a
``.gitignore`` of its own, so git never sees it). Each server gets a private work directory
(its logs, its config, and a ``TMPDIR`` of its own so that its pid file, which TorchServe keeps
in the temp directory, belongs to this server alone), free loopback ports, and either
TorchServe's default logging or a quiet log4j2 configuration (``quiet=True``: WARN, with the
access, model and metrics logs off), passed with ``vmargs`` in its ``config.properties``.
Stopping waits for the Java process (and its Python workers) to be gone, and kills what is
left of them by pid.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.management import ManagementClient

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-torchserve"
VERSION = "0.12.0"
#: torch comes from the machine's local wheels when they have it (no download).
#: torch-workflow-archiver 0.2.15 is the one TorchServe 0.12 ships with (benchmarks.workflow).
PACKAGES = (f"torchserve=={VERSION}", f"torch-model-archiver=={VERSION}",
            "torch-workflow-archiver==0.2.15", "pyyaml", "captum",
            "torch==2.14.1", "torchvision==0.29.1")  # torchvision: its image_classifier
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0

QUIET_LOG4J2 = """\
<?xml version="1.0" encoding="UTF-8"?>
<!-- TorchServe at its quietest that still reports problems: no access, model or metric logs. -->
<Configuration status="WARN">
  <Appenders>
    <Console name="STDOUT" target="SYSTEM_OUT">
      <PatternLayout pattern="%d{ISO8601} [%-5p] %t %c - %m%n"/>
    </Console>
  </Appenders>
  <Loggers>
    <Logger name="ACCESS_LOG" level="off" additivity="false"/>
    <Logger name="MODEL_LOG" level="off" additivity="false"/>
    <Logger name="MODEL_METRICS" level="off" additivity="false"/>
    <Logger name="TS_METRICS" level="off" additivity="false"/>
    <Logger name="io.netty" level="error"/>
    <Logger name="org.pytorch.serve" level="warn"/>
    <Root level="warn">
      <AppenderRef ref="STDOUT"/>
    </Root>
  </Loggers>
</Configuration>
"""


class TorchServeError(RuntimeError):
    pass


def ensure_venv(venv: Path = VENV, packages: Sequence[str] = PACKAGES) -> Path:
    """Make the TorchServe venv, or complete it, unless it has ``packages``; returns its bin."""
    bin_dir = venv / "bin"
    stamp = venv / ".bench-packages"  # what the last install here installed
    wanted = "\n".join(packages) + "\n"
    if stamp.exists() and stamp.read_text() == wanted:
        return bin_dir
    if not (bin_dir / "python").exists():
        print(f"creating {venv} (once; several minutes)", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        (venv / ".gitignore").write_text("*\n")
    print(f"installing into {venv}: {' '.join(packages)}", file=sys.stderr, flush=True)
    # NOTE: `python -m pip`, not bin/pip: a venv copied from another checkout keeps the
    # original's path in its scripts' #! lines, and its pip would install into the original.
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet",
                    "--disable-pip-version-check", *packages], check=True, timeout=3600,
                   env=clean_env())
    stamp.unlink(missing_ok=True)  # a new file: a hardlinked copy's stamp is not shared
    stamp.write_text(wanted)
    return bin_dir


def archive(bin_dir: Path, store: Path, name: str, handler: Path, *, version: str = "1.0",
            model_file: Path | None = None, serialized_file: Path | None = None,
            extra_files: Sequence[Path] = (), config_file: Path | None = None,
            archive_format: str = "default") -> str:
    """Pack a ``.mar`` with TorchServe's own ``torch-model-archiver``; returns its file name.
    ``archive_format``: its ``--archive-format`` (``zip-store``: no compression, quick for
    large incompressible weights; a ``.mar`` all the same)."""
    command = [str(bin_dir / "torch-model-archiver"), "--model-name", name, "--version",
               version, "--handler", str(handler), "--export-path", str(store), "--force",
               "--archive-format", archive_format]
    if model_file is not None:
        command += ["--model-file", str(model_file)]
    if serialized_file is not None:
        command += ["--serialized-file", str(serialized_file)]
    if extra_files:
        command += ["--extra-files", ",".join(str(path) for path in extra_files)]
    if config_file is not None:
        command += ["--config-file", str(config_file)]
    _run_archiver(command)
    return f"{name}.mar"


def _run_archiver(command: list[str]) -> None:
    """Run one of TorchServe's archivers; TorchServeError with its output when it fails."""
    done = subprocess.run(command, timeout=600, capture_output=True, text=True, check=False,
                          env=clean_env())
    if done.returncode != 0:
        raise TorchServeError(f"{Path(command[0]).name} failed ({done.returncode}): "
                              f"{(done.stderr or done.stdout).strip()[-2000:]}")


def workflow_archive(bin_dir: Path, store: Path, name: str, spec: Path, handler: Path,
                     extra_files: Sequence[Path] = ()) -> str:
    """Pack a ``.war`` with TorchServe's own ``torch-workflow-archiver``; returns its file
    name."""
    command = [str(bin_dir / "torch-workflow-archiver"), "--workflow-name", name,
               "--spec-file", str(spec), "--handler", str(handler), "--export-path",
               str(store), "--force"]
    if extra_files:
        command += ["--extra-files", ",".join(str(path) for path in extra_files)]
    _run_archiver(command)
    return f"{name}.war"


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment for TorchServe's tools, less PYTHONPATH: this repository's
    ``model_archiver`` package would shadow TorchServe's."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return {**env, **(extra or {})}


def free_ports(count: int) -> list[int]:
    """Ports the kernel just had free on 127.0.0.1 (TorchServe cannot bind port 0)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass(frozen=True)
class Install:
    """How to run a TorchServe 0.12: its ``torchserve`` command, and what its environment
    needs (PYTHONPATH for its ``ts`` package, JAVA_HOME for its Java runtime)."""

    command: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    description: str = ""


def venv_install(venv: Path = VENV) -> Install:
    """TorchServe from its own venv (made on first use)."""
    return Install((str(ensure_venv(venv) / "torchserve"),), {}, f"the venv {venv}")


#: ``torchserve`` run by an interpreter that imports ``ts`` from PYTHONPATH: its workers run
#: on that interpreter (TorchServe passes its own ``sys.executable`` to the Java frontend).
_LAUNCHER = ("import sys; sys.argv[0] = 'torchserve'; "
             "from ts.model_server import start; start()")


def home_install(ts_home: Path, java_home: Path | None = None,
                 python: str = sys.executable) -> Install:
    """TorchServe from a folder holding its ``ts`` package, run by ``python`` (whose
    packages its workers use: torch, torchvision, captum), with the Java runtime of
    ``java_home`` (None: ``java`` on PATH): how it runs on a GPU host without a package
    index (../shared/gpu.md)."""
    env = {"PYTHONPATH": str(ts_home)}
    if java_home is not None:
        env["JAVA_HOME"] = str(java_home)
    return Install((python, "-c", _LAUNCHER), env,
                   f"ts from {ts_home}, Java from {java_home or 'PATH'}")


def find_install(work: Path, sources: Sequence[Path] = (ROOT / ".whl",)) -> tuple[
        Install | None, str]:
    """A TorchServe 0.12 this host can run, without a package index, and where it came
    from; or None and why not. Looked for, in order:

    * ``TS_HOME`` (a folder holding ``ts``) and ``JAVA_HOME`` from the environment;
    * in ``sources`` (``.whl/``): TorchServe's wheel or a ``ts`` package packed as
      ``*.tar.xz``/``*.tar.gz``, and a Java runtime packed so (a folder with ``bin/java``),
      unpacked into ``work``;
    * the benchmarks' venv (``.venv-torchserve``), then the tests' archiver venv's ``ts``
      with ``java`` from PATH.

    Its workers need captum (TorchServe's image_classifier imports it) in this interpreter.
    """
    if importlib.util.find_spec("captum") is None:
        return None, f"captum is not installed for {sys.executable} (TorchServe's " \
                     "image_classifier imports it; its wheel belongs in .whl/)"
    ts_home = _env_path("TS_HOME")
    java_home = _env_path("JAVA_HOME")
    for source in sources:
        if ts_home is None:
            ts_home = _unpack_ts(source, work / "ts-home")
        if java_home is None:
            java_home = _unpack_java(source, work / "jre")
    if ts_home is None and (VENV / "bin" / "torchserve").exists():
        return venv_install(VENV), f"the venv {VENV}"
    if ts_home is None:
        archiver_venv = sorted(ROOT.glob(".venv-torchserve-archiver/lib/python3*/site-packages"))
        if archiver_venv and (archiver_venv[0] / "ts" / "model_server.py").exists():
            ts_home = work / "ts-link"
            ts_home.mkdir(parents=True, exist_ok=True)
            link = ts_home / "ts"
            if not link.exists():
                link.symlink_to(archiver_venv[0] / "ts")
    if ts_home is None:
        return None, "no TorchServe: no TS_HOME, no torchserve wheel or ts archive in " \
                     f"{', '.join(map(str, sources))}, no {VENV.name}"
    java = java_home / "bin" / "java" if java_home is not None else shutil.which("java")
    if java is None or subprocess.run([str(java), "-version"], capture_output=True,
                                      check=False, timeout=60).returncode != 0:
        return None, "no Java runtime: no JAVA_HOME, no packed runtime with bin/java in " \
                     f"{', '.join(map(str, sources))}, no java on PATH"
    install = home_install(ts_home, java_home)
    return install, install.description


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value and Path(value).is_dir() else None


def _unpack_ts(source: Path, target: Path) -> Path | None:
    """A folder holding TorchServe's ``ts`` package, from a wheel or an archive in
    ``source`` (None: none there)."""
    for wheel in sorted(source.glob("torchserve-*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target, [name for name in archive.namelist()
                                        if name.startswith("ts/")])
        return target
    for packed in sorted([*source.glob("*ts*.tar.*"), *source.glob("torchserve*.tar.*")]):
        found = _unpacked(packed, target, "ts/model_server.py")
        if found is not None:
            return found.parent.parent
    return None


def _unpack_java(source: Path, target: Path) -> Path | None:
    """A Java runtime (the folder of ``bin/java``) packed in ``source`` (None: none)."""
    for packed in sorted([*source.glob("*jre*.tar.*"), *source.glob("*jdk*.tar.*"),
                          *source.glob("*java*.tar.*")]):
        found = _unpacked(packed, target / packed.name.split(".tar")[0], "bin/java")
        if found is not None:
            found.chmod(found.stat().st_mode | 0o111)
            return found.parent.parent
    return None


def _unpacked(packed: Path, target: Path, wanted: str) -> Path | None:
    """``packed`` (a tar archive) unpacked into ``target`` (once), and the path of
    ``wanted`` in it, at most three folders down (None: not there)."""
    if not target.exists():
        with tarfile.open(packed) as archive:
            archive.extractall(target, filter="tar")
    for depth in range(4):
        for found in target.glob("/".join(["*"] * depth + [wanted])):
            return found
    return None


class TorchServe(ManagementClient):
    """A TorchServe 0.12 on free loopback ports, started with ``torchserve --start``."""

    def __init__(self, model_store: Path, *, quiet: bool = False,
                 env: Mapping[str, str] | None = None, venv: Path = VENV,
                 workflow_store: Path | None = None, extra_vmargs: str = "",
                 extra_properties: Sequence[str] = (), ready_poll_s: float = 0.5,
                 install: Install | None = None) -> None:
        self.install = install if install is not None else venv_install(venv)
        self.ready_poll_s = ready_poll_s
        self.model_store = model_store
        self.workflow_store = workflow_store
        self.quiet = quiet
        self.work = Path(tempfile.mkdtemp(prefix="bench-torchserve-"))
        (self.work / "tmp").mkdir()
        ports = free_ports(5)
        self.inference = f"http://127.0.0.1:{ports[0]}"
        self.management = f"http://127.0.0.1:{ports[1]}"
        self.metrics = f"http://127.0.0.1:{ports[2]}"
        self.grpc_inference_port = ports[3]
        properties = [
            f"inference_address={self.inference}",
            f"management_address={self.management}",
            f"metrics_address={self.metrics}",
            "grpc_inference_address=127.0.0.1",
            "grpc_management_address=127.0.0.1",
            f"grpc_inference_port={ports[3]}",
            f"grpc_management_port={ports[4]}",
            "default_workers_per_model=1",
            # The system-metrics collector starts a Python process every minute: noise.
            "disable_system_metrics=true",
            *extra_properties,  # e.g. load_models=x.mar: loaded before /ping says Healthy
        ]
        vmargs = [extra_vmargs] if extra_vmargs else []
        if quiet:
            log_config = self.work / "log4j2.xml"
            log_config.write_text(QUIET_LOG4J2)
            vmargs.append(f"-Dlog4j.configurationFile=file://{log_config}")
        if vmargs:
            properties.append(f"vmargs={' '.join(vmargs)}")
        self.config = self.work / "config.properties"
        self.config.write_text("\n".join(properties) + "\n")
        # TMPDIR: TorchServe keeps its pid file in the temp dir; this one is ours alone.
        self.env = clean_env({**self.install.env, **(env or {}), "TMPDIR": str(self.work / "tmp"),
                              "LOG_LOCATION": str(self.work / "logs"),
                              "METRICS_LOCATION": str(self.work / "logs")})
        self.pid: int | None = None

    def __enter__(self) -> TorchServe:
        workflows = (["--workflow-store", str(self.workflow_store)]
                     if self.workflow_store is not None else [])
        subprocess.run([*self.install.command, "--start", "--ncs", "--disable-token-auth",
                        "--enable-model-api", "--model-store", str(self.model_store),
                        "--ts-config", str(self.config), *workflows],
                       cwd=self.work, env=self.env, check=True, timeout=120,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pid_file = self.work / "tmp" / ".model_server.pid"
        self.pid = int(pid_file.read_text().split()[0]) if pid_file.exists() else None
        try:
            self._wait_ready()
        except BaseException as error:
            self.__exit__(type(error), error, None)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.inference}/ping", timeout=5) as response:
                    if response.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            if self.pid is not None and not _alive(self.pid):
                raise TorchServeError(f"TorchServe exited; logs in {self.work / 'logs'}")
            time.sleep(self.ready_poll_s)
        raise TorchServeError(f"TorchServe not ready in {START_TIMEOUT_S:.0f} s")

    def __exit__(self, *exc: object) -> None:
        import psutil

        processes: list[psutil.Process] = []
        if self.pid is not None:
            try:
                java = psutil.Process(self.pid)
                processes = [java, *java.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        subprocess.run([*self.install.command, "--stop"], cwd=self.work, env=self.env,
                       timeout=120, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       check=False)
        _, alive = psutil.wait_procs(processes, timeout=STOP_TIMEOUT_S)
        for process in alive:  # only the processes this server started
            print(f"killing TorchServe process {process.pid} left behind", file=sys.stderr)
            process.kill()
        psutil.wait_procs(alive, timeout=10)
        if exc and exc[0] is not None:
            print(f"TorchServe's logs are in {self.work / 'logs'}", file=sys.stderr)
        else:
            shutil.rmtree(self.work, ignore_errors=True)  # its logs can be large

    def failure(self, what: str, status: int, text: str) -> Exception:
        return TorchServeError(f"TorchServe {what}: {status} {text} (its model log: "
                               f"{self.work / 'logs' / 'model_log.log'})")


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def main() -> int:
    """Smoke test: start, register the echo example, one request, stop."""
    store = Path(tempfile.mkdtemp(prefix="bench-ts-store-"))
    bin_dir = ensure_venv()
    mar = archive(bin_dir, store, "echo", ROOT / "examples" / "echo" / "echo_handler.py")
    with TorchServe(store, quiet=True) as server:
        server.register(mar, batch_size=8, max_batch_delay=5, initial_workers=1)
        request = urllib.request.Request(f"{server.inference}/predictions/echo", data=b"hello",
                                         headers={"Content-Type": "application/octet-stream"})
        with urllib.request.urlopen(request, timeout=30) as response:
            print(response.status, response.read())
        print(json.dumps(server.describe("echo"), indent=1)[:400])
    shutil.rmtree(store, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
