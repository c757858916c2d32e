"""The test suite, by how much of the system a test runs.

* ``tests/unit``: one module at a time, in this process; no worker process and no socket
  where avoidable (seconds in all).
* ``tests/integration``: a real server (in this process, or ``torchserve`` in its own) with
  real worker processes, driven over HTTP and gRPC on free loopback ports, or, with the
  ``async_server`` fixture, through its inference plane on the test's own event loop.
* ``tests/compat``: TorchServe compatibility: archives made by TorchServe's own
  torch-model-archiver (``make test`` installs it in ``.venv-torchserve-archiver``; without
  it these tests skip) and TorchServe custom handlers.
* ``tests/e2e``: whole-system, large-model and long runs: the installed commands, the real
  ResNet-152 example, the soak. Every test there is marked ``slow``.

Markers (pyproject.toml): ``slow`` (a large model or a long whole-system run) and ``gpu``
(needs CUDA; such a test also skips itself without it). ``make test`` and plain ``pytest``
run everything; the quick loop leaves the slow tests out::

    .venv/bin/python -m pytest -m "not slow"
"""
