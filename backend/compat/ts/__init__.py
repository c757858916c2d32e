"""batchserve's stand-in for TorchServe's ``ts`` package (see ``backend.compat``).

Every public module, class and function of TorchServe 0.12's ``ts`` is here under the same
name and signature (``tests/unit/test_ts_coverage.py`` compares them with the real wheel),
written against batchserve's own backend. Handler-facing modules (``ts.torch_handler``,
``ts.handler_utils``, ``ts.utils``, ``ts.context``) behave as TorchServe's in our worker.
TorchServe's worker-side plumbing (``ts.protocol``, ``ts.service``, ``ts.model_loader``,
``ts.model_service_worker``, ``ts.async_service``) works too, speaking TorchServe's own
socket protocol, though batchserve's worker (``backend.process.worker``) does not use it. What
cannot apply here says so when used: ``ts.model_server.start`` runs batchserve's
``torchserve`` instead of TorchServe's Java frontend.

``ts.__version__`` is the TorchServe release whose API this package provides (0.12.0);
``context.system_properties["server_version"]`` is batchserve's own version.
"""

from . import version

__version__ = version.__version__
