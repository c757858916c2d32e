"""``torchserve``: start (in the background or foreground) and stop the server.

Flags are TorchServe's. argparse rather than click: ``--models a=a.mar b=b.mar`` takes a
variable number of values after one flag, which click options cannot express.

In a container ``torchserve --start`` is the container's command (KServe's runtime runs just
that), so it must not return: as PID 1, or when ``BATCHSERVE_FOREGROUND`` says so, it stays in
the foreground as ``--foreground`` does, logs to stdout and drains on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import configparser
import json
import logging
import logging.config
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from frontend import __version__
from frontend.allocator import tune_allocator
from frontend.config import ServerConfig, load_config, parse_bool
from frontend.config.vertex import ARCHIVE, MODEL_NAME, vertex_env
from frontend.errors import ConfigError
from frontend.models.startup import early_forkserver
from frontend.models.storage import model_folder
from frontend.observe import log4j
from frontend.observe.log4j_pattern import translate
from frontend.observe.logs import (
    SERVER_LOG,
    SERVER_PATTERN,
    EscapingLogRecord,
    console_logging,
    open_server_log,
)
from frontend.processes import python_module
from frontend.torchserve_keys import NO_EFFECT

if TYPE_CHECKING:
    import psutil

logger = logging.getLogger("batchserve")

_WORKER_FLAG = ("a flag of TorchServe's backend worker, not of torchserve: batchserve starts "
                "its workers itself, each on a private Unix socket")

STATE_FILE = "server.json"
STOP_TIMEOUT_S = 180.0
#: How often a background start looks whether its server is up (it returns that much later).
START_POLL_S = 0.05
#: Set by a container image: ``torchserve --start`` stays in the foreground ("1"/"true"), or
#: goes to the background even as PID 1 ("0"/"false").
FOREGROUND_ENV = "BATCHSERVE_FOREGROUND"
#: An argument of the background-started server's command line, as TorchServe's Java main
#: class is of its server's: tools find TorchServe's server among all processes by it (the
#: SageMaker toolkit's ``serve`` waits on that process and forwards SIGTERM to it; scripts
#: ``pkill -f`` it). The server drops it from its arguments.
PROCESS_MARKER = "org.pytorch.serve.ModelServer"


def state_dir() -> Path:
    """The per-user folder that holds the running server's PID/state file (mode 0700)."""
    override = os.environ.get("BATCHSERVE_STATE_DIR")
    if override:
        path = Path(override)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "batchserve"
    else:
        path = Path("/tmp") / f"batchserve-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid != os.getuid():
        raise ConfigError(f"{path} belongs to another user; set BATCHSERVE_STATE_DIR")
    path.chmod(0o700)
    return path


#: TorchServe 0.12's flags that mean nothing here: flag -> (its aliases, why; logged once at
#: start). Those that are also config keys give the key's reason.
IGNORED_FLAGS: dict[str, tuple[tuple[str, ...], str]] = {
    "--cpp-log-config": ((), NO_EFFECT["cpp_log_config"]),
    "--plugins-path": (("--ppath",), NO_EFFECT["plugins_path"]),
    # TorchServe's backend worker's flags (ts/model_service_worker.py), which its Java
    # frontend passes to each worker it starts.
    "--sock-type": ((), _WORKER_FLAG),
    "--sock-name": ((), _WORKER_FLAG),
    "--host": ((), _WORKER_FLAG),
    "--port": ((), _WORKER_FLAG),
    "--async": ((), _WORKER_FLAG),
}
#: The ignored flags that take no value.
_IGNORED_SWITCHES = frozenset({"--async"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchserve", description="batchserve: a TorchServe-compatible model server")
    # As TorchServe's: neither --start nor --stop (nor --version) starts the server.
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--start", action="store_true", help="start the model server")
    action.add_argument("--stop", action="store_true", help="stop the running model server")
    action.add_argument("-v", "--version", action="store_true",
                        help="print the version and exit")
    parser.add_argument("--ts-config", dest="ts_config", type=Path,
                        help="configuration file (config.properties)")
    parser.add_argument("--model-store", dest="model_store", type=Path,
                        help="folder that holds the model archives")
    parser.add_argument("--models", nargs="+", default=None, metavar="MODEL",
                        help="models to load at startup: name=x.mar, x.mar, or all")
    parser.add_argument("--workflow-store", dest="workflow_store", type=Path,
                        help="folder that holds the workflow archives (.war); default: the "
                             "model store")
    parser.add_argument("--workflows", nargs="+", default=None, metavar="WORKFLOW",
                        help="workflows to load at startup: name=x.war, x.war, or all")
    parser.add_argument("--log-config", dest="log_config", type=Path,
                        help="logging configuration: TorchServe's log4j2 XML file (mapped "
                        "onto Python logging), or a Python logging file (ini format)")
    parser.add_argument("--foreground", action="store_true",
                        help="stay in the foreground and log to the terminal")
    parser.add_argument("--ncs", "--no-config-snapshots", dest="ncs", action="store_true",
                        help="do not write model snapshots")
    parser.add_argument("--disable-token-auth", "--dt", dest="disable_token_auth",
                        action="store_true", help="serve without token authorization")
    parser.add_argument("--enable-model-api", dest="enable_model_api", action="store_true",
                        help="allow registering and unregistering models at runtime")
    ignored = parser.add_argument_group(
        "TorchServe's flags that have no effect here (accepted, and logged with the reason)")
    for flag, (aliases, _why) in IGNORED_FLAGS.items():
        if flag in _IGNORED_SWITCHES:
            ignored.add_argument(flag, *aliases, dest=_dest(flag), action="store_true")
        else:
            ignored.add_argument(flag, *aliases, dest=_dest(flag), metavar="VALUE")
    # TorchServe's worker takes it (ts/arg_parser.py); here it is the metrics_config key.
    parser.add_argument("--metrics-config", dest="metrics_config", type=Path,
                        help="metrics configuration (TorchServe's metrics.yaml)")
    return parser


def ignored_flags(args: argparse.Namespace) -> dict[str, str]:
    """The flags given that have no effect here, each with why."""
    return {flag: why for flag, (_aliases, why) in IGNORED_FLAGS.items()
            if getattr(args, _dest(flag)) not in (None, False)}


def _dest(flag: str) -> str:
    """The attribute argparse keeps an ignored flag's value in."""
    return flag.lstrip("-").replace("-", "_")


def cli_overrides(args: argparse.Namespace) -> dict[str, str]:
    overrides: dict[str, str] = {}
    if args.model_store is not None:
        overrides["model_store"] = str(args.model_store)
    if args.models:
        overrides["load_models"] = ",".join(args.models)
    if args.workflow_store is not None:
        overrides["workflow_store"] = str(args.workflow_store)
    if args.workflows:
        overrides["load_workflows"] = ",".join(args.workflows)
    if args.enable_model_api:
        overrides["enable_model_api"] = "true"
    if args.disable_token_auth:
        overrides["disable_token_authorization"] = "true"
    if args.ncs:
        overrides["snapshot_disabled"] = "true"
    if args.metrics_config is not None:
        overrides["metrics_config"] = str(args.metrics_config)
    return overrides


def config_file(args: argparse.Namespace) -> Path | None:
    """--ts-config, else $TS_CONFIG_FILE, else ./config.properties when present (TorchServe)."""
    if args.ts_config is not None:
        return Path(args.ts_config)
    if os.environ.get("TS_CONFIG_FILE"):
        return Path(os.environ["TS_CONFIG_FILE"])
    default = Path("config.properties")
    return default if default.is_file() else None


def resolve_config(args: argparse.Namespace) -> ServerConfig:
    overrides = cli_overrides(args)
    vertex = vertex_mode(args, overrides)
    config = load_config(config_file(args), overrides, vertex=vertex)
    if config.model_store is None:
        raise ConfigError("Missing mandatory parameter --model-store (or model_store= in the "
                          "config file)")
    if not config.model_store.is_dir():
        raise ConfigError(f"model store {config.model_store} is not a folder")
    if config.workflow_store is not None and not config.workflow_store.is_dir():
        raise ConfigError(f"workflow store {config.workflow_store} is not a folder")
    return config


def vertex_mode(args: argparse.Namespace, overrides: dict[str, str]) -> dict[str, str] | None:
    """Vertex AI's ``AIP_*`` environment, when it is set and the command line names no models:
    the keys that serve what Google's prebuilt PyTorch image serves (docs/container.md,
    "Vertex AI"), its ``model.mar`` fetched from ``AIP_STORAGE_URI``; None otherwise. Its
    model store replaces ``--model-store``."""
    vertex = vertex_env(os.environ)
    if vertex is None:
        return None
    if args.models:
        logger.warning("Vertex AI's AIP_* variables are set, but --models names the models: "
                       "serving those, as without AIP_*")
        return None
    if overrides.pop("model_store", None) is not None:
        logger.info("--model-store has no effect under Vertex AI: the model store is "
                    "AIP_STORAGE_URI's")
    store = model_folder(vertex.storage_uri)
    logger.info("Vertex AI: %s/%s (AIP_STORAGE_URI %s) as %r on port %d; health %s, "
                "predictions %s; %s", store, ARCHIVE, vertex.storage_uri, MODEL_NAME,
                vertex.http_port, vertex.health_route, vertex.predict_route,
                " ".join(f"{k}={v}" for k, v in vertex.recorded.items()) or "no other AIP_*")
    return vertex.overrides(str(store))


# ---- state file -------------------------------------------------------------------------

def read_state() -> dict[str, object] | None:
    path = state_dir() / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    pid = state.get("pid")
    # Our own PID is stale too: a restarted container's PID 1 finds its predecessor's file.
    if not isinstance(pid, int) or pid == os.getpid() or not _is_our_server(pid):
        path.unlink(missing_ok=True)  # stale: the server died without cleaning up
        return None
    return dict(state)


def _is_our_server(pid: int) -> bool:
    import psutil

    try:
        cmdline = psutil.Process(pid).cmdline()
    except psutil.Error:
        return False
    # `python -m frontend --foreground` (background start) or the `torchserve` script itself,
    # started with --start or, as TorchServe allows, with no action at all.
    return not {"--stop", "--version", "-v"} & set(cmdline) and any(
        part == "frontend" or Path(part).name == "torchserve" for part in cmdline)


def write_state(state: dict[str, object]) -> None:
    path = state_dir() / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.chmod(0o600)
    tmp.replace(path)


def remove_state(pid: int) -> None:
    path = state_dir() / STATE_FILE
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass


# ---- foreground -------------------------------------------------------------------------

def stays_in_foreground(args: argparse.Namespace, environ: Mapping[str, str], pid: int
                        ) -> bool:
    """``--foreground``; else what the container says (``BATCHSERVE_FOREGROUND``); else
    whether this is the container's main process (PID 1), which must not return."""
    if args.foreground:
        return True
    value = environ.get(FOREGROUND_ENV, "").strip()
    if not value:
        return pid == 1
    try:
        return parse_bool(value)
    except ValueError:
        raise ConfigError(f"{FOREGROUND_ENV}={environ[FOREGROUND_ENV]!r}: expected true or "
                          "false") from None


def setup_logging(log_config: Path | None, stream: TextIO, server_log: bool = False) -> bool:
    """Set up this process's logging: by ``log_config`` when given (TorchServe's log4j2 XML,
    or Python's ini format), else to ``stream`` in TorchServe's layout (and, with
    ``server_log``, to ts_log.log once the configuration says where: ``open_server_log``).
    Returns whether a log4j2 file set up the loggers of TorchServe's names (the server then
    writes its access, model and metric logs through them). A file that cannot be used is a
    ``ConfigError``."""
    # Every message escaped, whatever writes it (a user's log config too): a client's bytes
    # in a logged value cannot forge a line.
    logging.setLogRecordFactory(EscapingLogRecord)
    # A Python warning is a log record (py.warnings) in the layout of the others, not raw text
    # on stderr, which a background server's log file is.
    logging.captureWarnings(True)
    if log_config is not None:
        if not log_config.is_file():
            raise ConfigError(f"--log-config file not found: {log_config}")
        if log4j.is_log4j_xml(log_config):
            log4j.configure(log4j.read(log_config), stream, sys.stderr,
                            translate(SERVER_PATTERN).formatter)
            return True
        if not log4j.is_log4j_properties(log_config):
            try:
                logging.config.fileConfig(log_config, disable_existing_loggers=False)
            except (KeyError, ValueError, RuntimeError, OSError, configparser.Error) as exc:
                raise ConfigError(f"--log-config {log_config}: neither a log4j2 XML file nor "
                                  f"a Python logging configuration (ini format): {exc!r}"
                                  ) from exc
            return False
    console_logging(stream, server_log)
    if log_config is not None:
        logger.info("--log-config %s is a log4j properties file: its format is not read here "
                    "(log4j2's XML format is, and Python's ini format)", log_config)
    return False


def _is_log4j_xml(log_config: Path | None) -> bool:
    """Whether ``--log-config`` names a log4j2 XML file; one that cannot be used is a
    ``ConfigError`` now (before a background start spawns the server)."""
    if log_config is None:
        return False
    if not log_config.is_file():
        raise ConfigError(f"--log-config file not found: {log_config}")
    if not log4j.is_log4j_xml(log_config):
        return False
    log4j.read(log_config)
    return True


def run_foreground(config: ServerConfig, named_loggers: bool = False,
                   console_is_log: bool = False) -> int:
    """Serve until stopped; ``named_loggers``: a log4j2 --log-config set up the loggers the
    access, model and metric logs go to (``setup_logging``); ``console_is_log``: this
    process's output is the server log (a background start's), where only log lines go."""
    # NOTE: this process forks its workers while grpc.aio threads run; grpcio's fork handlers
    # would crash such a child before it can exec (SIGSEGV). We never use gRPC in a forked
    # child, so turn them off; grpcio reads this when it is first imported (frontend.server
    # imports it, below).
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    tune_allocator()  # request bodies and batch frames kept off mmap (frontend/allocator.py)
    # First of all: the startup models' fork server imports torch while this process imports
    # the server's modules, binds and unpacks (frontend/models/startup.py).
    forkserver = early_forkserver(config)
    from frontend.server import Server

    def announce(server: Server) -> None:
        bound = server.bound
        assert bound is not None
        write_state({
            "pid": os.getpid(),
            "inference": str(bound.inference),
            "management": str(bound.management),
            "metrics": str(bound.metrics) if bound.metrics else None,
            "grpc_inference_port": bound.grpc_inference_port,
            "grpc_management_port": bound.grpc_management_port,
            "kserve_rest": str(bound.kserve_rest) if bound.kserve_rest else None,
            "kserve_grpc_port": bound.kserve_grpc_port,
            "key_file": None if config.disable_token_authorization
            else str(config.key_file.resolve()),
        })
        # TorchServe's own line first: its launcher and test harness (ts.launcher.start)
        # read the server's output until they see it. (A background start's launcher
        # prints it itself.)
        if not console_is_log:
            print("Model server started.", flush=True)
        logger.info("batchserve is serving: inference %s, management %s, metrics %s",
                    bound.inference, bound.management, bound.metrics)

    server = Server(config, on_started=announce, named_loggers=named_loggers,
                    forkserver=forkserver)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.request_stop)
        try:
            await server.serve()
        finally:
            remove_state(os.getpid())

    try:
        _run(main())
    except ConfigError as exc:
        # Found only at start (a certificate file that cannot be used, load_models=all
        # without a model store): exits as the configuration errors found before it do.
        logger.error("batchserve failed to start: %s", exc)
        return 2
    except OSError as exc:
        logger.error("batchserve failed to start: %s", exc)
        return 1
    finally:
        if forkserver is not None:  # stopped, if the server stopped before it adopted it
            forkserver.discard()
    return 0


def _run(coro: Coroutine[object, object, None]) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        asyncio.run(coro)
        return
    uvloop.run(coro)


# ---- background start and stop ----------------------------------------------------------

def start_background(argv: Sequence[str], config: ServerConfig, log4j_file: bool = False
                     ) -> int:
    """Start the server in a process of its own and return once it answers. Its output goes
    to ``log_location/ts_log.log`` (the server log, TorchServe's); with a log4j2
    ``--log-config`` (``log4j_file``) it is
    this command's own output, as TorchServe's Java server inherits it: that file's console
    appenders write there (SageMaker's toolkit reads the server's log from it) and its file
    appenders write the files it names."""
    state_dir()  # fail early if it cannot be made
    command = [*python_module(sys.executable, "frontend"), PROCESS_MARKER, *argv,
               "--foreground"]
    log_path: Path | None = None
    if log4j_file:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)
    else:
        config.log_location.mkdir(parents=True, exist_ok=True)
        log_path = config.log_location / SERVER_LOG
        with open(log_path, "ab") as log:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
    where = f"{log_path}" if log_path is not None else "the output above and the files of " \
        "its --log-config"
    deadline = time.monotonic() + config.default_startup_timeout_s + 60
    while time.monotonic() < deadline:
        code = process.poll()
        if code is not None:
            tail = f" Last log lines from {log_path}:\n{_tail(log_path)}" if log_path else \
                f" See {where}."
            print(f"batchserve failed to start (exit code {code}).{tail}", file=sys.stderr)
            return 2 if code == 2 else 1  # 2: its configuration
        state = read_state()
        if state is not None and state.get("pid") == process.pid and _ping(str(state["inference"])):
            keys = state.get("key_file") or f"off ({config.token_authorization_off_by})"
            # TorchServe's line, which its launcher awaits (the server wrote it already where
            # its output is this command's).
            started = "" if log4j_file else "Model server started.\n"
            print(f"{started}batchserve started (pid {process.pid}).\n"
                  f"  inference API:  {state['inference']}\n"
                  f"  management API: {state['management']}\n"
                  f"  metrics API:    {state['metrics']}\n"
                  f"  gRPC ports:     {state.get('grpc_inference_port')} (inference), "
                  f"{state.get('grpc_management_port')} (management)\n"
                  f"  token keys:     {keys}\n"
                  f"  logs:           {log_path or 'as its --log-config says'}", flush=True)
            return 0
        time.sleep(START_POLL_S)
    process.terminate()
    print(f"batchserve did not become ready in time; see {where}", file=sys.stderr)
    return 1


def _ping(base_url: str) -> bool:
    # An https:// inference address is asked without checking its certificate: the question
    # is only whether our own child (its pid is in the state file) answers yet, and its
    # certificate may name a public host or come from a CA this machine does not trust.
    context = None
    if base_url.startswith("https://"):
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(f"{base_url}/ping", timeout=2, context=context) as response:
            return bool(response.status == 200)
    except urllib.error.HTTPError as exc:
        return exc.code == 500  # answering, though a model is unhealthy
    except OSError:
        return False


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop_server() -> int:
    import psutil

    state = read_state()
    if state is None:
        print("batchserve is not running.")
        return 0
    pid = int(state["pid"])  # type: ignore[call-overload]
    try:
        server = psutil.Process(pid)
        family = [server, *server.children(recursive=True)]
        server.send_signal(signal.SIGTERM)
    except psutil.NoSuchProcess:
        print("batchserve is not running.")
        return 0
    alive = _wait_gone(family, STOP_TIMEOUT_S)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    _wait_gone(alive, 10)
    remove_state(pid)
    print(f"batchserve stopped (pid {pid}).")
    return 0


def _wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until each process has exited (a zombie counts as exited); return the rest."""

    deadline = time.monotonic() + timeout_s
    alive = list(processes)
    while alive:
        alive = [p for p in alive if _running(p)]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return alive


def _running(process: psutil.Process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    argv = [arg for arg in (sys.argv[1:] if argv is None else argv) if arg != PROCESS_MARKER]
    args = build_parser().parse_args(argv)
    if args.version:
        print(f"batchserve {__version__} (TorchServe-compatible)")
        return 0
    if args.stop:
        return stop_server()
    try:
        foreground = stays_in_foreground(args, os.environ, os.getpid())
    except ConfigError as exc:
        print(f"torchserve: error: {exc}", file=sys.stderr)
        return 2
    try:
        log4j_file = _is_log4j_xml(args.log_config)
        # In the foreground the log is the server's stdout (a container's log); a background
        # start reports on the terminal, the server logging as its --log-config says, else
        # to its file.
        named_loggers = setup_logging(args.log_config if foreground else None,
                                      sys.stdout if foreground else sys.stderr,
                                      server_log=foreground)
        config = resolve_config(args)
        running = read_state()
        if running is not None:
            raise ConfigError(f"batchserve is already running (pid {running['pid']}); "
                              "stop it with torchserve --stop")
        console_is_log = False
        if foreground:
            try:
                console_is_log = open_server_log(config.log_location, sys.stdout)
            except OSError as exc:
                raise ConfigError(f"cannot write the server log in {config.log_location} "
                                  f"(log_location): {exc.strerror}") from exc
    except ConfigError as exc:
        print(f"torchserve: error: {exc}", file=sys.stderr)
        return 2
    if foreground:
        for flag, reason in ignored_flags(args).items():
            logger.info("%s has no effect here: %s", flag, reason)
        return run_foreground(config, named_loggers, console_is_log)
    child_argv = [a for a in argv if a != "--foreground"]
    if "--start" not in child_argv:  # started without --start, as TorchServe allows
        child_argv.insert(0, "--start")
    return start_background(child_argv, config, log4j_file)


if __name__ == "__main__":
    sys.exit(main())
