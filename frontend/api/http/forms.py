"""Form bodies (multipart/form-data, x-www-form-urlencoded) split into named inputs.

TorchServe hands each form field to the handler as its own input (commonly ``data``); the
frontend only splits the bytes, it never decodes the payloads themselves.
"""

from __future__ import annotations

from urllib.parse import parse_qsl

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header

from frontend.errors import BadRequest, excerpt


def is_form(content_type: str) -> bool:
    lowered = content_type.lower()
    return lowered.startswith(("multipart/form-data", "application/x-www-form-urlencoded"))


def parse_form(content_type: str, body: bytes, max_fields: int) -> list[tuple[str, bytes, str]]:
    """Return (field name, bytes, content type) for each field of a form body; BadRequest for
    more than ``max_fields`` fields (parsing stops there: a body of 100k tiny parts must not
    hold the event loop)."""
    too_many = BadRequest(f"a request may carry at most {max_fields} form fields "
                          "(max_request_inputs)")
    if content_type.lower().startswith("application/x-www-form-urlencoded"):
        try:
            pairs = parse_qsl(body.decode("latin-1"), keep_blank_values=True,
                              max_num_fields=max_fields)
        except ValueError:
            raise too_many from None
        return [(name, value.encode(), "text/plain") for name, value in pairs]
    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if not boundary:
        raise BadRequest("multipart/form-data body without a boundary")
    return _parse_multipart(boundary, body, max_fields, too_many)


#: Header lines a multipart part may carry (each costs a parser callback).
MAX_PART_HEADERS = 16


def _parse_multipart(boundary: bytes, body: bytes, max_fields: int,
                     too_many: BadRequest) -> list[tuple[str, bytes, str]]:
    fields: list[tuple[str, bytes, str]] = []
    headers: dict[bytes, bytes] = {}
    header_name = bytearray()
    header_value = bytearray()
    data = bytearray()
    header_lines = 0

    def on_part_begin() -> None:
        nonlocal header_lines
        if len(fields) >= max_fields:
            raise too_many
        headers.clear()
        data.clear()
        header_lines = 0

    def on_header_field(buffer: bytes, start: int, end: int) -> None:
        header_name.extend(buffer[start:end])

    def on_header_value(buffer: bytes, start: int, end: int) -> None:
        header_value.extend(buffer[start:end])

    def on_header_end() -> None:
        nonlocal header_lines
        header_lines += 1
        if header_lines > MAX_PART_HEADERS:
            raise BadRequest(f"a multipart part may carry at most {MAX_PART_HEADERS} headers")
        headers[bytes(header_name).lower()] = bytes(header_value)
        header_name.clear()
        header_value.clear()

    def on_part_data(buffer: bytes, start: int, end: int) -> None:
        data.extend(buffer[start:end])

    def on_part_end() -> None:
        _, options = parse_options_header(headers.get(b"content-disposition", b""))
        name = options.get(b"name")
        if name is None:
            raise BadRequest("multipart part without a name in Content-Disposition")
        content_type = headers.get(b"content-type", b"").decode("latin-1")
        if not content_type:
            content_type = "application/octet-stream" if b"filename" in options else "text/plain"
        fields.append((name.decode("utf-8", "replace"), bytes(data), content_type))

    try:
        parser = MultipartParser(boundary, {
            "on_part_begin": on_part_begin,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        })
        parser.write(body)
        parser.finalize()
    except FormParserError as exc:  # MultipartParseError and a bad boundary alike
        raise BadRequest(f"malformed multipart body: {excerpt(str(exc))}") from None
    if parser.state != MultipartState.END:
        raise BadRequest("malformed multipart body: it ends before its closing boundary")
    return fields
