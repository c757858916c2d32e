"""``ts.model_service_worker``: TorchServe's Python worker, which a TorchServe (Java)
frontend starts and drives over a socket with TorchServe's frames (``ts.protocol``).

batchserve never runs it: its frontend starts ``backend.process.worker``, which speaks
``protos/worker.proto``. It is here, working, for code that imports it, and so that
``python -m ts.model_service_worker --sock-type unix --sock-name /tmp/.ts.sock.9000``
serves a model to a TorchServe frontend as TorchServe's own worker would: it listens, takes
one connection, answers LOAD with ``ts.model_loader`` and each PREDICT with the loaded
``ts.service.Service`` (or, with ``--async``, ``ts.async_service.AsyncService``).

Metrics: with ``--metrics-config``, handlers' metrics go to TorchServe's metrics cache for it
(``ts.metrics.metric_cache_yaml_impl``), as in TorchServe; otherwise to a cache without a
configuration.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import sys
from typing import Any

from backend.errors import describe, is_out_of_memory

from .arg_parser import ArgParser
from .async_service import AsyncService
from .metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
from .model_loader import ModelLoaderFactory
from .protocol.otf_message_handler import create_load_model_response, retrieve_msg

__all__ = ["BENCHMARK", "DEBUG", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MAX_FAILURE_THRESHOLD",
           "SOCKET_ACCEPT_TIMEOUT", "WORLD_RANK", "WORLD_SIZE", "ArgParser", "AsyncService",
           "MetricsCacheYamlImpl", "ModelLoaderFactory", "TorchModelServiceWorker",
           "create_load_model_response", "retrieve_msg"]

MAX_FAILURE_THRESHOLD = 5
SOCKET_ACCEPT_TIMEOUT = 30.0
DEBUG = False
BENCHMARK = os.getenv("TS_BENCHMARK") in ("True", "true", "TRUE")
LOCAL_RANK = int(os.getenv("LOCAL_RANK", "0"))
WORLD_SIZE = int(os.getenv("WORLD_SIZE", "0"))
WORLD_RANK = int(os.getenv("RANK", "0"))
LOCAL_WORLD_SIZE = int(os.getenv("LOCAL_WORLD_SIZE", "0"))

logger = logging.getLogger(__name__)


class TorchModelServiceWorker:
    """One worker: a listening socket (``unix`` at ``s_name``, its number offset by the
    local rank, or ``tcp`` at ``host_addr:port_num`` + rank) and the model it loads."""

    def __init__(self, s_type: str | None = None, s_name: str | None = None,
                 host_addr: str | None = None, port_num: int | None = None,
                 metrics_config: str | None = None, async_comm: bool | None = False) -> None:
        self.sock_type = s_type
        self.port: int | str
        if s_type == "unix":
            if s_name is None:
                raise ValueError("Wrong arguments passed. No socket name given.")
            stem, dot, number = s_name.rpartition(".")
            if not dot or not number.isdigit():
                raise ValueError(f"socket name {s_name!r} must end in .<number> "
                                 f"(TorchServe's /tmp/.ts.sock.9000)")
            self.sock_name = f"{stem}.{int(number) + LOCAL_RANK}"
            self.port = -1
            try:
                os.remove(self.sock_name)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise RuntimeError(f"socket already in use: {self.sock_name}.") from exc
            logger.info("Listening on port: %s", self.sock_name)
        elif s_type == "tcp":
            if port_num is None:
                raise ValueError("Wrong arguments passed. No socket port given.")
            self.sock_name = host_addr if host_addr is not None else "127.0.0.1"
            self.port = int(port_num) + LOCAL_RANK
            logger.info("Listening on addr:port: %s:%d", self.sock_name, self.port)
        else:
            raise ValueError(f"Incomplete data provided: socket type {s_type!r} is not unix "
                             f"or tcp")
        family = socket.AF_INET if s_type == "tcp" else socket.AF_UNIX
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.metrics_cache = _metrics_cache(metrics_config)
        self.async_comm = bool(async_comm)

    def load_model(self, load_model_request: dict[str, Any]) -> tuple[Any, str, int]:
        """A decoded LOAD message -> (the Service or None, message, code): 200 loaded, 507
        out of memory, 500 any other failure."""
        model_name = "?"
        try:
            model_dir = _text(load_model_request["modelPath"])
            model_name = _text(load_model_request["modelName"])
            handler = _text(load_model_request["handler"]) or None
            envelope = _text(load_model_request.get("envelope") or b"") or None
            batch_size = int(load_model_request.get("batchSize") or 1)
            gpu = load_model_request.get("gpu")
            limit = bool(load_model_request.get("limitMaxImagePixels", True))
            logger.info("model_name: %s, batchSize: %d", model_name, batch_size)
            if self.metrics_cache is not None and hasattr(self.metrics_cache, "model_name"):
                self.metrics_cache.model_name = model_name
            service = ModelLoaderFactory.get_model_loader().load(
                model_name, model_dir, handler, None if gpu is None else int(gpu), batch_size,
                envelope, limit, self.metrics_cache)
            logger.debug("Model %s loaded.", model_name)
            return service, f"loaded model {model_name}", 200
        except Exception as exc:
            if is_out_of_memory(exc):
                logger.exception("Load model %s: out of memory", model_name)
                return None, "System out of memory", 507
            logger.exception("Failed to load model %s, exception %s", model_name,
                             describe(exc))
            return None, "Unknown exception", 500

    def _load(self, cl_socket: Any, message: dict[str, Any]) -> Any:
        service, result, code = self.load_model(message)
        cl_socket.sendall(create_load_model_response(code, result))
        if code != 200:
            raise RuntimeError(f"{code} - {result}")
        service.set_cl_socket(cl_socket)
        return service

    def handle_connection(self, cl_socket: Any) -> None:
        """Answer the frontend's frames until it disconnects (the process then exits)."""
        service = None
        while True:
            command, message = retrieve_msg(cl_socket)
            if command == b"I":
                if service is None:
                    raise RuntimeError(f"Received command: {command!r}, but service is not "
                                       f"loaded")
                response = service.predict(message)
                if LOCAL_RANK == 0 and response is not None:
                    cl_socket.sendall(response)
            elif command == b"L":
                service = self._load(cl_socket, message)
            else:
                raise ValueError(f"Received unknown command: {command!r}")

    def handle_connection_async(self, cl_socket: Any) -> None:
        """Load the model, then serve its requests with AsyncService."""
        logger.info("handle_connection_async")
        command, message = retrieve_msg(cl_socket)
        if command != b"L":
            raise ValueError(f"Unexpected command (Only expecting LOAD command): {command!r}")
        error = AsyncService(self._load(cl_socket, message)).run()
        if error:
            raise RuntimeError(f"Error in AsyncService:\n {error}")

    def run_server(self) -> None:
        """Bind, listen, and serve each connection (TorchServe's frontend opens one)."""
        if not DEBUG:
            self.sock.settimeout(SOCKET_ACCEPT_TIMEOUT)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.sock_type == "unix":
            self.sock.bind(self.sock_name)
        else:
            self.sock.bind((self.sock_name, int(self.port)))
        self.sock.listen(1)
        logger.info("[PID]%d", os.getpid())
        logger.info("Torch worker started.")
        logger.info("Python runtime: %s", platform.python_version())
        while True:
            connection, _ = self.sock.accept()
            connection.setblocking(True)
            logger.info("Connection accepted: %s.", connection.getsockname())
            if self.async_comm:
                self.handle_connection_async(connection)
            else:
                self.handle_connection(connection)


def _text(value: str | bytes | bytearray) -> str:
    return value if isinstance(value, str) else bytes(value).decode("utf-8")


def _metrics_cache(metrics_config: str | None) -> MetricsCacheYamlImpl | None:
    """TorchServe's metrics cache for ``metrics_config``; None without one (the context
    then keeps batchserve's own metrics)."""
    if not metrics_config:
        return None
    cache = MetricsCacheYamlImpl(config_file_path=metrics_config)
    cache.initialize_cache()
    return cache


def main() -> int:
    """``python -m ts.model_service_worker``: serve until the frontend disconnects."""
    logging.basicConfig(stream=sys.stdout, format="%(message)s", level=logging.INFO)
    args = ArgParser.model_service_worker_args().parse_args()
    try:
        TorchModelServiceWorker(args.sock_type, args.sock_name, args.host, args.port,
                                args.metrics_config, args.async_comm).run_server()
    except TimeoutError:
        logger.error("Backend worker did not receive connection in: %d", SOCKET_ACCEPT_TIMEOUT)
    except Exception:
        logger.error("Backend worker process died.", exc_info=True)
    finally:
        if args.sock_type == "unix" and args.sock_name and os.path.exists(args.sock_name):
            os.remove(args.sock_name)
    return 1


if __name__ == "__main__":
    sys.exit(main())
