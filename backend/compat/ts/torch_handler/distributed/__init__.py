"""``ts.torch_handler.distributed``: base handlers for models split over several GPUs
(DeepSpeed, PiPPy)."""
