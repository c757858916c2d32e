"""Intermediate (streamed) responses, TorchServe's way and a simpler one.

TorchServe handlers call ``send_intermediate_predict_response(ret, req_id_map, message,
code, context)`` for each part but the last, then return the last part. Here a handler may
do exactly that, or return a generator for a request: every item it yields is sent as one
part, as soon as it is yielded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def send_intermediate_predict_response(
    ret: Sequence[Any], req_id_map: Mapping[int, str], message: str, code: int, context: Any
) -> None:
    """Send ``ret[idx]`` to each request of ``req_id_map`` now (TorchServe's signature;
    ``message`` is accepted for compatibility and not sent)."""
    del message
    for idx in req_id_map:
        context.send_intermediate(idx, ret[idx], code)
