"""Workflows (TorchServe's .war): archives, specs, DAGs, their registry and loading."""
