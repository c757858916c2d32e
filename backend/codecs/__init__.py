"""The shapes a request takes through a handler: TorchServe's request, KServe v1 instances,
Open Inference (v2) tensors and TorchServe's service envelopes, each turned into the handler's
rows and its results back into the response (``rows.py``; v2 in ``open_inference.py`` and
``v2_outputs.py``, the envelopes in ``envelopes.py``)."""
