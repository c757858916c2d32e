"""``ts.handler_utils.utils``: streaming parts of a response before the handler returns, and
importing a class by its dotted name.

TorchServe writes a part to the frontend's socket itself; in batchserve's worker it goes
through the context's ``partial_sink`` (``backend.streaming``). A context made by
``ts.service.Service`` (TorchServe's own protocol) gets TorchServe's frame on its socket.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

from backend import streaming

from ..context import Context
from ..protocol.otf_message_handler import create_predict_response

__all__ = ["Context", "create_predict_response", "import_class",
           "send_intermediate_predict_response"]


def import_class(class_name: str, module_prefix: str | None = None) -> type:
    """The class ``"module.Class"`` names (``module_prefix`` prepended to its module, or the
    class looked up in ``module_prefix`` itself when ``class_name`` has no module).

    Raises ImportError when the name, its module or the class is missing.
    """
    if not class_name:
        raise ImportError("class name is not defined")
    module_name, _, name = class_name.rpartition(".")
    if module_prefix:
        module = importlib.import_module(
            f"{module_prefix}.{module_name}" if module_name else module_prefix)
    elif module_name:
        module = importlib.import_module(module_name)
    else:
        raise ImportError(f"module name is not defined for class {class_name!r}")
    found = getattr(module, name, None)
    if found is None:
        raise ImportError(f"class:{name} not found in module:{module.__name__}.")
    return found  # type: ignore[no-any-return]


def send_intermediate_predict_response(
    ret: list[Any], req_id_map: Mapping[int, str], message: str, code: int, context: Context
) -> None:
    """Send ``ret[idx]`` to each request of ``req_id_map`` now, before the handler returns
    (HTTP: a chunk of a chunked response; gRPC StreamPredictions: one message). Only rank 0
    of a distributed worker sends, as in TorchServe."""
    if str(os.getenv("LOCAL_RANK", "0")) != "0":
        return
    if getattr(context, "partial_sink", None) is not None:
        streaming.send_intermediate_predict_response(ret, req_id_map, message, code, context)
        return
    socket = getattr(context, "cl_socket", None)
    if socket is None:
        raise RuntimeError("intermediate responses need a running worker (the context has "
                           "neither batchserve's partial sink nor TorchServe's socket)")
    frame = create_predict_response(ret, req_id_map, message, code, context, True)
    if frame is not None:
        socket.sendall(frame)
