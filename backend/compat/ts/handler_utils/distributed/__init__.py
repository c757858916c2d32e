"""``ts.handler_utils.distributed``: set-up for large models split over several GPUs with
DeepSpeed (``deepspeed``) or PiPPy (``pt_pippy``); each needs its package at import."""
