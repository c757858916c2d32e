"""``ts.model_service``: the model-service API of TorchServe's predecessor (MMS)."""

from . import model_service

__all__ = ["model_service"]
