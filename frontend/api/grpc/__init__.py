"""The gRPC transports, as ``api/http/`` holds the HTTP ones: TorchServe's inference and
management services, KServe's Open Inference service, the listeners (``servers.py``), what
they share (``common.py``: one decorator for the token check and the error mapping) and the
bounded reading of prediction requests (``wire.py``)."""
