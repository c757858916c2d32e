"""TorchServe's configuration keys that mean nothing here, each with the reason.

TorchServe 0.12 reads these from config.properties (its ``ConfigManager``, and
``ts/model_server.py`` for ``vmargs`` and ``plugins_path``), or writes them there itself. A
file that sets one is accepted: the server says once, at start, why the key has no effect
(``frontend/config/load.py``, ``load_config``), instead of calling it misspelt. Every other key of
TorchServe's is a setting here (``ServerConfig``).
"""

from __future__ import annotations

_NETTY = "batchserve's frontend is one asyncio (uvloop) event loop, not Netty"

#: key -> why it has no effect in batchserve.
NO_EFFECT: dict[str, str] = {
    # The JVM and Netty.
    "vmargs": "JVM arguments, and there is no JVM",
    "netty_client_threads": f"Netty's threads for worker connections: {_NETTY}",
    "use_native_io": "Netty's epoll/kqueue transport: batchserve always uses uvloop (libuv)",
    "io_ratio": f"Netty's share of time for I/O: {_NETTY}",
    "prefer_direct_buffer": "the JVM's off-heap buffers for Netty, and there is no JVM",
    "async_logging": "log4j2's asynchronous loggers: batchserve already writes its access log "
                     "off the request path",
    "model_server_home": "where TorchServe's Java frontend finds its installation",
    "plugins_path": "TorchServe's Java plugin jars (custom endpoints) cannot load in "
                    "batchserve",
    # Written by TorchServe itself (they appear in its config snapshots).
    "tsConfigFile": "TorchServe writes the config file's path here; it is not a setting",
    "version": "TorchServe writes its own version here; it is not a setting",
    "python": "TorchServe's launcher always replaces it with its own interpreter; batchserve's "
              "workers run under the server's Python (a model's own venv with useVenv)",
    # Machinery batchserve does without.
    "debug": "TorchServe's debug mode (workers started by hand, no timeouts) does not exist "
             "here: the server always starts and supervises its workers",
    "initial_worker_port": "TorchServe's worker ports: batchserve's workers talk to the "
                           "frontend over private Unix sockets",
    "initial_distribution_port": "torchrun's ports for models split across processes: "
                                 "batchserve runs one process per worker, without torchrun",
    "cpp_log_config": "TorchServe's C++ backend is not part of batchserve",
    "system_metrics_cmd": "the server reads the host's CPU, memory, disk and GPU figures "
                          "itself (psutil, nvidia-ml-py) instead of running a collector script",
    "cpu_launcher_enable": "Intel's CPU launcher is not used: cpu_affinity and "
                           "cpu_cores_per_worker give each worker its own cores",
    "cpu_launcher_args": "Intel's CPU launcher is not used: cpu_affinity and "
                         "cpu_cores_per_worker give each worker its own cores",
    "ipex_enable": "batchserve's handlers do not apply Intel Extension for PyTorch (a handler "
                   "of your own may)",
    "ipex_gpu_enable": "batchserve's handlers do not apply Intel Extension for PyTorch (a "
                       "handler of your own may)",
    "ts_open_inference_protocol": "the Open Inference Protocol is always served here (REST "
                                  "/v2 on the inference port, GRPCInferenceService on the gRPC "
                                  "inference port)",
    "ts_header_key_sequence_id": "stateful models read TorchServe's default header names "
                                 "(ts_request_sequence_id, _start, _end) whatever this says",
    "ts_header_key_sequence_start": "stateful models read TorchServe's default header names "
                                    "(ts_request_sequence_id, _start, _end) whatever this says",
    "ts_header_key_sequence_end": "stateful models read TorchServe's default header names "
                                  "(ts_request_sequence_id, _start, _end) whatever this says",
    # Not TorchServe's, but in its KServe sample config.properties.
    "NUM_WORKERS": "in KServe's sample config for TorchServe, which does not read it either: "
                   "default_workers_per_model sets the workers",
}
