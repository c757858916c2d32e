"""batchserve's stand-in for TorchServe's ``ts`` package (see ``backend.compat``).

Only the public pieces that custom handlers import are here, each written against our own
backend; TorchServe's frontend-facing modules (``ts.protocol``, ``ts.model_service_worker``,
``ts.model_loader``) have no counterpart because our worker replaces them.
"""
