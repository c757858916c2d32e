"""batchserve's frontend process: HTTP and gRPC APIs, batching, worker management."""

from importlib.metadata import PackageNotFoundError, version

try:
    #: The one version string: setup.py's, as installed.
    __version__ = version("batchserve")
except PackageNotFoundError:  # pragma: no cover - run from a tree that was never installed
    __version__ = "0.0.0+unknown"
