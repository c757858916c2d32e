"""The metrics a handler reports through ``context.metrics``: TorchServe 0.12's API
(``ts.metrics.*`` re-exports these classes, so a handler's ``MetricTypes`` and the errors it
catches are the very ones the worker's cache uses).

TorchServe's worker writes each value as a ``[METRICS]`` line on its stdout for the frontend
to parse; here each value goes into the cache's ``MetricSink`` instead, and the worker sends
what was reported with the batch's result (or with ``Loaded``, for ``initialize``): see
``sink.py``.
"""
