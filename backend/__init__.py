"""batchserve's worker side: the processes that load one model's archive and answer its batches.

Its folders are floors, top down: ``process/`` (the worker loop and its protocol, the fork
server, the weights owner), ``compat/`` (TorchServe's ``ts`` package), ``service/`` (one loaded
model), ``codecs/`` (a request's shapes through a handler), ``handlers/`` (the built-in
handlers), ``weights/``, then the ground: ``context.py``, ``errors.py``, ``imports.py``,
``optional.py``, ``streaming.py`` and ``metrics/`` (TorchServe's handler metrics). A module
imports its own floor and those below, never one above (tests/unit/test_layout.py,
``BACKEND_FLOORS``; docs/architecture.md, "The backend's folders").
"""
