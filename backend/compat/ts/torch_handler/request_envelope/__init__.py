"""``ts.torch_handler.request_envelope``: TorchServe's envelopes as classes a handler can use
itself (``KServeEnvelope(handler.handle).handle(data, context)``).

batchserve's worker applies the ``service_envelope`` a model is configured with through
``backend.codecs.envelopes``; these classes wrap the same code in TorchServe's shape
(``parse_input`` over a whole batch, ``format_output`` back). Where TorchServe's kserve
envelopes read only the first request of a batch, these unwrap and answer every request.
"""
