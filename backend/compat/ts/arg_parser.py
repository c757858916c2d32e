"""``ts.arg_parser``: the command lines of TorchServe's ``torchserve`` and of its Python
worker, as argparse parsers with TorchServe's flags and destinations.

batchserve's own ``torchserve`` command (``frontend/cli.py``) parses its command line
itself; these parsers are for scripts that build or read TorchServe command lines.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


class ArgParser:
    """The parsers, as static methods."""

    @staticmethod
    def ts_parser() -> argparse.ArgumentParser:
        """``torchserve --start|--stop|--version [options]``."""
        parser = argparse.ArgumentParser(prog="torchserve", description="Torchserve")
        action = parser.add_mutually_exclusive_group(required=False)
        action.add_argument("-v", "--version", action="store_true",
                            help="Return TorchServe Version")
        action.add_argument("--start", action="store_true", help="Start the model-server")
        action.add_argument("--stop", action="store_true", help="Stop the model-server")
        parser.add_argument("--ts-config", dest="ts_config",
                            help="Configuration file for model server")
        parser.add_argument("--model-store", required=False, dest="model_store",
                            help="Model store location from where local or default models can "
                                 "be loaded")
        parser.add_argument("--workflow-store", required=False, dest="workflow_store",
                            help="Workflow store location from where local or default "
                                 "workflows can be loaded")
        parser.add_argument("--models", metavar="MODEL_PATH1 MODEL_NAME=MODEL_PATH2...",
                            nargs="+",
                            help="Models to be loaded using [model_name=]model_location "
                                 "format. Location can be a HTTP URL or a model archive file "
                                 "in MODEL_STORE.")
        parser.add_argument("--log-config", dest="log_config",
                            help="Log4j configuration file for model server")
        parser.add_argument("--cpp-log-config", dest="cpp_log_config",
                            help="log configuration file for cpp backend")
        parser.add_argument("--foreground", action="store_true",
                            help="Run the model server in foreground. If this option is "
                                 "disabled, the model server will run in the background.")
        parser.add_argument("--no-config-snapshots", "--ncs", dest="no_config_snapshots",
                            action="store_true",
                            help="Prevents to server from storing config snapshot files.")
        parser.add_argument("--plugins-path", "--ppath", dest="plugins_path",
                            help="plugin jars to be included in torchserve class path")
        parser.add_argument("--disable-token-auth", "--dt", dest="token_auth",
                            action="store_true",
                            help="if this option is set then token authorization is disabled")
        parser.add_argument("--enable-model-api", dest="model_mode", action="store_true",
                            help="enables model control apis")
        return parser

    @staticmethod
    def model_service_worker_args() -> argparse.ArgumentParser:
        """The worker's: ``--sock-type unix|tcp``, ``--sock-name``, ``--host``, ``--port``,
        ``--metrics-config``, ``--async``."""
        parser = argparse.ArgumentParser(prog="model-server-worker",
                                         description="Model Server Worker")
        parser.add_argument("--sock-type", required=True, dest="sock_type", type=str,
                            choices=["unix", "tcp"],
                            help="Socket type the model service worker would use: a unix "
                                 "domain socket, or tcp with a host and port")
        parser.add_argument("--sock-name", required=False, dest="sock_name", type=str,
                            help="the socket's path when sock-type is unix")
        parser.add_argument("--host", type=str,
                            help="the IP address to bind when sock-type is tcp")
        parser.add_argument("--port", type=str, help="the port to bind when sock-type is tcp")
        parser.add_argument("--metrics-config", dest="metrics_config", type=str,
                            help="Metrics configuration file")
        parser.add_argument("--async", default=False, dest="async_comm", action="store_true",
                            help="Run async communication worker")
        return parser

    @staticmethod
    def extract_args(args: Sequence[str] | None = None) -> argparse.Namespace:
        """``torchserve``'s arguments, from ``args`` or the command line."""
        parser = ArgParser.ts_parser()
        return parser.parse_args(args) if args else parser.parse_args()
