"""``ts.protocol.otf_message_handler``: the binary frames TorchServe's Java frontend and its
Python worker exchange.

batchserve's own worker speaks ``protos/worker.proto`` instead; this codec is here for code
written against TorchServe's (``ts.service.Service.predict`` returns these bytes, and
``ts.model_service_worker`` serves a TorchServe frontend with them). All integers are 4-byte
big-endian; every string is its length, then its UTF-8 bytes; lists end with -1.

* LOAD (``b"L"``): model name, model path, batch size, handler, GPU id (-1: none),
  envelope, limitMaxImagePixels (one byte).
* PREDICT (``b"I"``): requests until -1, each its id, then headers (name, value) until -1,
  then inputs (name, content type, value) until -1.
* A predict response: code, message, then per request its id, content type, status, reason
  phrase, headers (a count, then name/value pairs) and body; then -1. A load response: code,
  message, -1.
"""

from __future__ import annotations

import io
import json
import logging
import os
import struct
import sys
from collections.abc import Mapping
from typing import Any, Protocol

from ..utils.util import deprecated

logger = logging.getLogger(__name__)

bool_size = 1
int_size = 4
END_OF_LIST = -1
LOAD_MSG = b"L"
PREDICT_MSG = b"I"
RESPONSE = 3

_INT = struct.Struct("!i")
#: Inputs of these content types reach the handler decoded, unless TS_DECODE_INPUT_REQUEST
#: says "false" (as TorchServe reads it).
_JSON = "application/json"
STREAM_NEXT_HEADER = "ts_stream_next"


class _Receiver(Protocol):
    def recv(self, size: int, /) -> bytes: ...


def _is_rank_zero() -> bool:
    """Only the first process of a distributed (torchrun) worker answers the frontend."""
    return str(os.getenv("LOCAL_RANK", "0")) == "0"


# ---- reading frames --------------------------------------------------------------------------


def retrieve_msg(conn: _Receiver) -> tuple[bytes, Any]:
    """The next command and its message: ``(b"L", {...})`` or ``(b"I", [request, ...])``.

    Raises ValueError for an unknown command. When the frontend closes the connection the
    process exits (SystemExit 0), as TorchServe's worker does.
    """
    command = bytes(_read(conn, 1))
    if command == LOAD_MSG:
        return command, _read_load(conn)
    if command == PREDICT_MSG:
        return command, _read_batch(conn)
    raise ValueError(f"Invalid command: {command!r}")


def _read(conn: _Receiver, length: int) -> bytearray:
    data = bytearray()
    while len(data) < length:
        chunk = conn.recv(length - len(data))
        if len(chunk) == 0:
            logger.info("Frontend disconnected.")
            sys.exit(0)
        data += chunk
    return data


def _read_int(conn: _Receiver) -> int:
    value: int = _INT.unpack(_read(conn, int_size))[0]
    return value


def _read_string(conn: _Receiver) -> bytearray:
    return _read(conn, _read_int(conn))


def _read_load(conn: _Receiver) -> dict[str, Any]:
    message: dict[str, Any] = {
        "modelName": _read_string(conn),
        "modelPath": _read_string(conn),
        "batchSize": _read_int(conn),
        "handler": _read_string(conn),
    }
    gpu = _read_int(conn)
    if gpu >= 0:
        message["gpu"] = gpu
    message["envelope"] = _read_string(conn)
    message["limitMaxImagePixels"] = bool(_read(conn, bool_size)[0])
    return message


def _read_batch(conn: _Receiver) -> list[dict[str, Any]]:
    batch = []
    while (length := _read_int(conn)) != END_OF_LIST:
        request: dict[str, Any] = {"requestId": _read(conn, length)}
        headers = []
        while (name_length := _read_int(conn)) != END_OF_LIST:
            headers.append({"name": _read(conn, name_length), "value": _read_string(conn)})
        request["headers"] = headers
        inputs = []
        while (name_length := _read_int(conn)) != END_OF_LIST:
            name = _read(conn, name_length).decode("utf-8")
            content_type = _read_string(conn).decode("utf-8")
            inputs.append({"name": name, "contentType": content_type,
                           "value": _decode_input(_read_string(conn), content_type)})
        request["parameters"] = inputs
        batch.append(request)
    return batch


def _decode_input(value: bytearray, content_type: str) -> Any:
    """JSON and text inputs decoded (TS_DECODE_INPUT_REQUEST unset or "true"), else bytes;
    a value that does not decode is passed on as it came."""
    if os.environ.get("TS_DECODE_INPUT_REQUEST", "true") != "true":
        return value
    try:
        if content_type == _JSON:
            return json.loads(value.decode("utf-8"))
        if content_type.startswith("text"):
            return value.decode("utf-8")
    except (ValueError, RecursionError):
        logger.warning("Failed decoding of %s input data. Forwarding encoded payload",
                       content_type, exc_info=True)
    return value


# ---- writing frames --------------------------------------------------------------------------


def _string(value: str | bytes | bytearray) -> bytes:
    data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    return _INT.pack(len(data)) + data


def encode_response_headers(resp_hdr_map: Mapping[str, str]) -> bytearray:
    """A count of headers, then each header's name and value."""
    message = bytearray(_INT.pack(len(resp_hdr_map)))
    for name, value in resp_hdr_map.items():
        message += _string(name) + _string(value)
    return message


def create_predict_response(
    ret: Any, req_id_map: Mapping[int, str], message: str, code: int, context: Any = None,
    ts_stream_next: bool = False,
) -> bytearray | None:
    """The response frame for a batch: ``ret[idx]`` for request ``req_id_map[idx]``, or, with
    ``ret`` None, an error for each. With a context, each request's content type, status and
    headers come from it; ``ts_stream_next`` marks an intermediate (streamed) part. None on a
    distributed worker's other ranks, which do not answer."""
    if not _is_rank_zero():
        return None
    frame = bytearray(_INT.pack(code)) + _string(message)
    for idx, request_id in req_id_map.items():
        frame += _string(request_id)
        if context is None:
            frame += _INT.pack(0) + _INT.pack(code) + _INT.pack(0) + _INT.pack(0)
        else:
            _mark_stream(context, idx, ret, ts_stream_next)
            content_type = context.get_response_content_type(idx) or ""
            status, phrase = context.get_response_status(idx)
            frame += _string(content_type) + _INT.pack(status if status is not None else 200)
            frame += _string(phrase or "")
            frame += encode_response_headers(context.get_response_headers(idx))
        if ret is None:
            frame += _string(b"error")
            continue
        try:
            frame += _string(_body(ret[idx]))
        except (TypeError, ValueError):
            logger.warning("Unable to serialize model output.", exc_info=True)
            return create_predict_response(None, req_id_map,
                                           "Unsupported model output data type.", 503)
    frame += _INT.pack(END_OF_LIST)
    return frame


def _mark_stream(context: Any, idx: int, ret: Any, ts_stream_next: bool) -> None:
    """TorchServe's streaming flag: "true" on an intermediate part; on a final answer, "false"
    if a part was sent before, or what the handler's stopping criteria say."""
    if ts_stream_next:
        context.set_response_header(idx, STREAM_NEXT_HEADER, "true")
    elif getattr(context, "stopping_criteria", None):
        stop = context.stopping_criteria[idx](ret[idx])
        if stop is not None:
            context.set_response_header(idx, STREAM_NEXT_HEADER, "false" if stop else "true")
    elif context.get_response_headers(idx).get(STREAM_NEXT_HEADER) == "true":
        context.set_response_header(idx, STREAM_NEXT_HEADER, "false")


def _body(value: Any) -> bytes:
    """bytes as they are, text as UTF-8, a tensor as torch.save writes it, anything else as
    indented JSON (TypeError when it is not JSON)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    torch = sys.modules.get("torch")  # a handler that returns tensors imported torch
    if torch is not None and isinstance(value, torch.Tensor):
        buffer = io.BytesIO()
        torch.save(value, buffer)
        return buffer.getvalue()
    return json.dumps(value, indent=2).encode("utf-8")


def create_load_model_response(code: int, message: str) -> bytearray:
    """The answer to LOAD: its code and message, and no predictions."""
    return bytearray(_INT.pack(code)) + _string(message) + _INT.pack(END_OF_LIST)


@deprecated(version=1.0,
            replacement="ts.handler_utils.utils.send_intermediate_predict_response")
def send_intermediate_predict_response(
    ret: Any, req_id_map: Mapping[int, str], message: str, code: int, context: Any = None
) -> None:
    """Send one intermediate part per request now (deprecated by TorchServe in favour of
    ``ts.handler_utils.utils.send_intermediate_predict_response``, which this calls)."""
    from ..handler_utils.utils import send_intermediate_predict_response as send

    send(ret, req_id_map, message, code, context)
