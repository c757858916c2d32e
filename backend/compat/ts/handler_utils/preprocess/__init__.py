"""``ts.handler_utils.preprocess``: NVIDIA DALI pipelines for image preprocessing
(``dali``; needs DALI at import) and the script that builds the default one (``built-in``)."""
