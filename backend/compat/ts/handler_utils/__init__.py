"""``ts.handler_utils``: what handlers use besides their base classes: intermediate responses
(``utils``), handler timing (``timer``), micro-batching (``micro_batching``), text helpers
(``text_utils``), Hugging Face streaming (``hf_batch_streamer``), DeepSpeed and PiPPy set-up
(``distributed``) and DALI pipelines (``preprocess``)."""
