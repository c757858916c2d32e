"""``ts.protocol``: TorchServe's frontend-worker wire format (``otf_message_handler``)."""
