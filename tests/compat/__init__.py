"""TorchServe compatibility: its own archiver's archives and custom handlers (see
tests/__init__.py)."""
