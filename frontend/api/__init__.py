"""The transports: HTTP (TorchServe's and KServe's REST) and gRPC; they parse and render."""
