"""Fetch a model archive over http(s) into the model store, safely.

This is the defence against TorchServe's SSRF advisory (CVE-2023-43654): the URL and every
redirect target are normalised (RFC 3986) and must then match ``allowed_urls`` in full, a path
with a ``..`` segment in any spelling is refused outright, the normalised URL is the one
fetched, the body is size-limited, and the archive appears in the store atomically under a
plain name, never replacing a file already there. Blocking: the caller runs it in a thread.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import ssl
import tempfile
from pathlib import Path
from typing import BinaryIO
from urllib.error import HTTPError, URLError
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit
from urllib.request import (
    HTTPDefaultErrorHandler,
    HTTPErrorProcessor,
    HTTPHandler,
    HTTPSHandler,
    OpenerDirector,
    ProxyHandler,
    Request,
)

from frontend.errors import ArchiveError, Conflict, Forbidden, ServeError, excerpt, quoted
from frontend.models.archive import ARCHIVE_SUFFIXES, require_allowed
from model_archiver.paths import UnsafePath, climbs, contained

MAX_REDIRECTS = 5
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
CHUNK_BYTES = 1 << 16
_SCHEMES = ("http", "https")
#: RFC 3986 2.3: percent-encodings of these mean the character itself (normalised away).
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_PERCENT = re.compile(r"%([0-9A-Fa-f]{2})")
#: How often a path is percent-decoded when looking for a hidden ``..`` (%252e%252e, ...).
_DECODE_ROUNDS = 4


class _ReturnRedirects(HTTPErrorProcessor):
    """Hand 3xx responses back to the caller instead of following them.

    urllib's own redirect handler would follow a redirect before we could check its target
    against ``allowed_urls`` (and it also follows ftp:// targets), so we follow them ourselves.
    """

    def http_response(
        self, request: Request, response: http.client.HTTPResponse
    ) -> http.client.HTTPResponse:
        if 300 <= response.status < 400:
            return response
        return super().http_response(request, response)  # type: ignore[no-any-return]

    https_response = http_response


def _build_opener() -> OpenerDirector:
    # Only the http(s) handlers: no file://, ftp:// or data: handling at all. Proxies from the
    # environment are honoured (an egress proxy is a normal deployment); allowed_urls still
    # governs the URL the proxy is asked for.
    opener = OpenerDirector()
    for handler in (ProxyHandler(), HTTPHandler(),
                    HTTPSHandler(context=ssl.create_default_context()),
                    HTTPDefaultErrorHandler(), _ReturnRedirects()):
        opener.add_handler(handler)
    return opener


def _decode_unreserved(path: str) -> str:
    """RFC 3986 6.2.2: unreserved characters decoded, other percent-encodings upper-cased."""

    def one(match: re.Match[str]) -> str:
        char = chr(int(match.group(1), 16))
        return char if char in _UNRESERVED else f"%{match.group(1).upper()}"

    return _PERCENT.sub(one, path)


def remove_dot_segments(path: str) -> str:
    """RFC 3986 5.2.4: the path with every ``.`` and ``..`` segment resolved."""
    output: list[str] = []
    for segment in path.split("/")[1:] if path.startswith("/") else path.split("/"):
        if segment == "..":
            if output:
                output.pop()
        elif segment != ".":
            output.append(segment)
    result = ("/" if path.startswith("/") else "") + "/".join(output)
    if path.endswith(("/.", "/..")) and not result.endswith("/"):
        result += "/"
    return result


def _has_parent_segment(path: str) -> bool:
    """Whether a server could read ``..`` in ``path``: any spelling of it as a segment,
    percent-encoded (even twice), split by ``/`` or ``\\``, or with ``;parameters``."""
    for _ in range(_DECODE_ROUNDS):
        if climbs("/".join(segment.split(";", 1)[0] for segment in re.split(r"[/\\]", path))):
            return True
        decoded = unquote(path)
        if decoded == path:
            return False
        path = decoded
    return True  # still encoded after several rounds: nobody needs that in an archive URL


def normalise_url(url: str) -> str:
    """The http(s) URL that is checked against ``allowed_urls`` and then fetched.

    Scheme and host are lower-cased, percent-encoded unreserved characters decoded, ``.``
    segments removed and the fragment (never sent) dropped, so that what ``allowed_urls``
    judges is exactly what is requested. A path with a ``..`` segment in any spelling is
    refused outright (TorchServe refuses a literal ``..``), and so are characters that HTTP
    clients and servers parse differently (backslashes, spaces, controls).
    """
    if any(char == "\\" or ord(char) <= 0x20 or ord(char) == 0x7F for char in url):
        raise ArchiveError(f"url {quoted(url)} has a backslash, a space or a control character")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ArchiveError(f"url {quoted(url)}: only http(s) archives can be downloaded")
    try:
        port = parts.port
    except ValueError:
        raise ArchiveError(f"url {quoted(url)} has an invalid port") from None
    host = parts.hostname
    if not host:
        raise ArchiveError(f"url {quoted(url)} names no host")
    if _has_parent_segment(parts.path):
        raise Forbidden(f"url {quoted(url)} is not allowed: its path has a '..' segment")
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc = f"{netloc}:{port}"
    userinfo, at, _ = parts.netloc.rpartition("@")
    if at:
        netloc = f"{userinfo}@{netloc}"
    path = remove_dot_segments(_decode_unreserved(parts.path)) or "/"
    return urlunsplit((scheme, netloc, path, parts.query, ""))


def check_allowed(url: str, allowed_urls: tuple[str, ...]) -> str:
    """The normalised ``url`` if ``allowed_urls`` admits it; Forbidden (403) otherwise."""
    normalised = normalise_url(url)
    require_allowed(normalised, allowed_urls,
                    None if normalised == url
                    else f"{quoted(url)} (normalised: {quoted(normalised)})")
    return normalised


def archive_name(url: str, suffixes: tuple[str, ...] = ARCHIVE_SUFFIXES) -> str:
    """The store file name for ``url``: its last path segment, unquoted, checked to be plain."""
    name = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
    # One part (no separator), a path inside the store, no controls. A leading dot is refused
    # too: list_store skips hidden files, and the download's own temporary files are hidden.
    is_plain = (
        _is_contained(name)
        and name != ""
        and not name.startswith(".")
        and "/" not in name
        and "\\" not in name
        and not any(ord(char) < 0x20 or char == "\x7f" for char in name)
    )
    if not is_plain:
        raise ArchiveError(f"url {quoted(url)} does not end in a plain archive file name")
    if not name.endswith(suffixes):
        raise ArchiveError(f"url {quoted(url)}: expected a {', '.join(suffixes)} archive, got "
                           f"{quoted(name)}")
    return name


def _is_contained(name: str) -> bool:
    try:
        contained(name)
    except UnsafePath:
        return False
    return True


def _open(opener: OpenerDirector, url: str, timeout_s: float) -> http.client.HTTPResponse:
    try:
        return opener.open(Request(url), timeout=timeout_s)  # type: ignore[no-any-return]
    except HTTPError as exc:
        exc.close()
        raise ArchiveError(f"downloading {quoted(url)} failed: HTTP {exc.code} "
                           f"{excerpt(str(exc.reason))}") from exc
    except URLError as exc:
        raise ArchiveError(f"cannot download {quoted(url)}: {_reason(exc.reason)}") from exc
    # OSError: a timeout while waiting for the response head is not wrapped in URLError.
    # ValueError: http.client's InvalidURL (control characters, a bad port).
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise ArchiveError(f"cannot download {quoted(url)}: {_reason(exc)}") from exc


def _open_following_redirects(
    url: str, allowed_urls: tuple[str, ...], timeout_s: float
) -> tuple[http.client.HTTPResponse, str]:
    """Open ``url``, following up to MAX_REDIRECTS redirects that allowed_urls admits."""
    opener = _build_opener()
    first_url = url
    for _ in range(MAX_REDIRECTS + 1):
        response = _open(opener, url, timeout_s)
        if not 300 <= response.status < 400:
            return response, url
        with response:
            location = response.headers.get("Location")
            status = response.status
        if status not in REDIRECT_STATUSES:
            raise ArchiveError(f"downloading {quoted(url)} failed: unexpected HTTP {status}")
        if not location:
            raise ArchiveError(f"downloading {quoted(url)} failed: HTTP {status} without a "
                               "Location")
        location = location.strip()
        if _has_parent_segment(urlsplit(location).path):  # before urljoin resolves it
            raise Forbidden(f"{quoted(url)} redirects to {quoted(location)}, which is refused: "
                            "its path has a '..' segment")
        target = urljoin(url, location)
        if urlsplit(target).scheme.lower() not in _SCHEMES:
            raise ArchiveError(f"{quoted(url)} redirects to {quoted(target)}: only http(s) is "
                               "followed")
        # Checked on every hop: an admitted server must not be able to point us anywhere else.
        try:
            url = check_allowed(target, allowed_urls)
        except ServeError as exc:
            raise Forbidden(f"{quoted(url)} redirects to {quoted(target)}, which is refused: "
                            f"{exc.message}") from None
    raise ArchiveError(f"downloading {quoted(first_url)} failed: more than {MAX_REDIRECTS} "
                       "redirects")


def _reason(exc: object) -> str:
    return excerpt(str(exc)) or type(exc).__name__


def _read_chunk(response: http.client.HTTPResponse, url: str) -> bytes:
    try:
        return response.read(CHUNK_BYTES)
    except (OSError, http.client.HTTPException) as exc:
        raise ArchiveError(f"downloading {quoted(url)} failed: {_reason(exc)}") from exc


def _stream_to(response: http.client.HTTPResponse, url: str, out: BinaryIO,
               max_bytes: int) -> None:
    # http.client's parse of Content-Length (None when chunked, absent or invalid), taken
    # before any read decrements it.
    declared = response.length
    too_large = f"archive at {quoted(url)} exceeds the download limit of {max_bytes} bytes"
    if declared is not None and declared > max_bytes:
        raise ArchiveError(too_large)
    received = 0
    while chunk := _read_chunk(response, url):
        received += len(chunk)
        if received > max_bytes:
            raise ArchiveError(too_large)
        out.write(chunk)
    # NOTE: http.client does not raise when a Content-Length body ends early; it just stops.
    if declared is not None and received != declared:
        raise ArchiveError(
            f"downloading {quoted(url)} failed: got {received} of {declared} bytes (connection "
            "closed)"
        )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def download_archive(
    url: str,
    model_store: Path,
    allowed_urls: tuple[str, ...],
    max_bytes: int,
    timeout_s: float = 60.0,
    suffixes: tuple[str, ...] = ARCHIVE_SUFFIXES,
) -> Path:
    """Download the archive at ``url`` into ``model_store`` and return its path.

    ``timeout_s`` bounds connecting and each socket read, not the whole transfer (a large
    archive may take longer); ``max_bytes`` bounds the body. Nothing is requested unless
    ``allowed_urls`` admits the normalised URL and the store has no file of that name yet.
    """
    url = check_allowed(url, allowed_urls)
    name = archive_name(url, suffixes)
    final = model_store / name
    conflict = f"archive {quoted(name)} already exists in the model store"
    if os.path.lexists(final):
        raise Conflict(conflict)

    response, final_url = _open_following_redirects(url, allowed_urls, timeout_s)
    with response:
        # mkstemp creates the file with mode 0600; the hard link below keeps that mode.
        fd, temp_name = tempfile.mkstemp(prefix=".download-", suffix=".part", dir=model_store)
        try:
            with os.fdopen(fd, "wb") as out:
                _stream_to(response, final_url, out, max_bytes)
                out.flush()
                os.fsync(out.fileno())
            # os.link fails if the name appeared meanwhile; rename would silently replace it.
            try:
                os.link(temp_name, final)
            except FileExistsError as exc:
                raise Conflict(conflict) from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp_name)
    _fsync_dir(model_store)
    return final
