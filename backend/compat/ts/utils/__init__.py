"""``ts.utils``: ``util`` (labels, PredictionException), ``hf_utils`` (Hugging Face
downloads), ``setup_model_venv`` and ``timeit_decorator``."""
