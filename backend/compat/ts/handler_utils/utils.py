"""``ts.handler_utils.utils``: streaming parts of a response before the handler returns.

TorchServe writes the part to the frontend socket itself; here it goes through the context's
``partial_sink``, which our worker installs (``backend.streaming``).
"""

from __future__ import annotations

from backend.streaming import send_intermediate_predict_response

__all__ = ["send_intermediate_predict_response"]
