"""download_archive against a real HTTP server on 127.0.0.1 (real sockets, no mocks)."""

from __future__ import annotations

import os
import re
import socket
import stat
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from frontend.errors import ArchiveError, Conflict, Forbidden
from frontend.models.download import (
    MAX_REDIRECTS,
    download_archive,
    normalise_url,
    remove_dot_segments,
)

LIMIT = 4096
OK_BODY = b"PK\x03\x04 the first archive " * 20
OK2_BODY = b"PK\x03\x04 the second archive"
BIG_BODY = b"x" * (4 * LIMIT)
STALL_S = 5.0
SHORT_TIMEOUT_S = 0.2
OK_PATHS = ("/ok.mar", "/model.tar.gz", "/model.tgz", "/my%20model.mar")


class _Server(ThreadingHTTPServer):
    # Not daemon threads: server_close() joins the handler threads, so none outlives a test.
    daemon_threads = False

    def __init__(self, model_store: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.model_store = model_store
        #: Every request path, in arrival order: proves which requests were (not) made.
        self.paths: list[str] = []
        #: Set at teardown to let stalled handlers finish.
        self.release = threading.Event()

    def handle_error(self, request: object, client_address: object) -> None:
        # The client hanging up on a refused body is expected; anything else is printed.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.server.paths.append(self.path)
        port = self.server.server_address[1]
        path = self.path
        hop = re.fullmatch(r"/hop-(\d+)\.mar", path)
        if path in OK_PATHS or path == "/ok/in.mar":
            self._send(OK_BODY)
        elif path == "/secret/s1.mar":
            self._send(b"PK\x03\x04 secret")
        elif path == "/ok/redirect-dotdot.mar":
            self._redirect("/ok/../secret/s1.mar")
        elif path == "/ok/redirect-encoded.mar":
            self._redirect(f"http://127.0.0.1:{port}/ok/%2e%2E/secret/s1.mar")
        elif path == "/ok2.mar":
            self._send(OK2_BODY)
        elif path == "/exact.mar":
            self._send(b"e" * LIMIT)
        elif path == "/big.mar":
            self._send(BIG_BODY)
        elif path == "/huge-declared.mar":
            # Declares far more than it sends: only a check of the header refuses it as too big.
            self._send(b"tiny", length=10**12)
        elif path == "/big-chunked.mar":
            self._send_chunked(BIG_BODY)
        elif path == "/big-close-delimited.mar":
            # HTTP/1.0 without Content-Length: the body ends when the connection closes.
            self._send(BIG_BODY, length=None)
        elif path == "/truncated.mar":
            self._send(b"0123456789", length=100)
        elif path == "/redirect-ok.mar":
            self._redirect("/ok2.mar")
        elif path == "/redirect-out.mar":
            self._redirect(f"http://127.0.0.2:{port}/ok.mar")
        elif path == "/redirect-file.mar":
            self._redirect("file:///etc/passwd")
        elif path == "/redirect-ftp.mar":
            self._redirect(f"ftp://127.0.0.1:{port}/ok.mar")
        elif hop:
            count = int(hop.group(1))
            if count:
                self._redirect(f"/hop-{count - 1}.mar")
            else:
                self._send(OK_BODY)
        elif path == "/error.mar":
            self.send_error(500)
        elif path == "/slow-head.mar":
            self.server.release.wait(STALL_S)
            self._send(OK_BODY)
        elif path == "/stall-body.mar":
            self.send_response(200)
            self.send_header("Content-Length", str(len(OK_BODY)))
            self.end_headers()
            self.wfile.write(OK_BODY[:10])
            self.server.release.wait(STALL_S)
            self.wfile.write(OK_BODY[10:])
        elif path == "/race.mar":
            # Another writer claims the name after the client checked it and before it links.
            (self.server.model_store / "race.mar").write_bytes(b"winner")
            self._send(OK_BODY)
        else:
            self.send_error(404)

    def _send(self, body: bytes, *, length: int | None = -1) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        if length is not None:
            self.send_header("Content-Length", str(len(body) if length == -1 else length))
        self.end_headers()
        self.wfile.write(body)

    def _send_chunked(self, body: bytes) -> None:
        self.protocol_version = "HTTP/1.1"
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        for start in range(0, len(body), 1024):
            chunk = body[start:start + 1024]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()


@dataclass
class Remote:
    server: _Server
    port: int

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    @property
    def allowed(self) -> tuple[str, ...]:
        """allowed_urls admitting this server only (not 127.0.0.2, not another port)."""
        return (rf"http://127\.0\.0\.1:{self.port}/.*",)

    @property
    def requests(self) -> list[str]:
        return list(self.server.paths)


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    # urllib honours proxy variables; the tests must talk to 127.0.0.1 directly.
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def remote(model_store: Path) -> Iterator[Remote]:
    server = _Server(model_store)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield Remote(server, server.server_address[1])
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def fetch(remote: Remote, model_store: Path, path: str, **kwargs: object) -> Path:
    options: dict[str, object] = {"allowed_urls": remote.allowed, "max_bytes": LIMIT,
                                  "timeout_s": 10.0, **kwargs}
    return download_archive(remote.url(path), model_store, **options)  # type: ignore[arg-type]


def store_names(model_store: Path) -> list[str]:
    return sorted(os.listdir(model_store))


@pytest.mark.parametrize(("path", "name"), [
    ("/ok.mar", "ok.mar"),
    ("/model.tar.gz", "model.tar.gz"),
    ("/model.tgz", "model.tgz"),
    ("/my%20model.mar", "my model.mar"),
])
def test_download_writes_the_exact_bytes_readable_by_the_owner_only(
        remote: Remote, model_store: Path, path: str, name: str) -> None:
    result = fetch(remote, model_store, path)

    assert result == model_store / name
    assert result.read_bytes() == OK_BODY
    assert stat.S_IMODE(result.stat().st_mode) == 0o600
    assert store_names(model_store) == [name]
    assert remote.requests == [path]


def test_a_body_of_exactly_max_bytes_is_accepted(remote: Remote, model_store: Path) -> None:
    assert fetch(remote, model_store, "/exact.mar").read_bytes() == b"e" * LIMIT


@pytest.mark.parametrize("patterns", [
    (),
    (r"http://127\.0\.0\.1:{port}/allowed/.*",),
    # fullmatch, not match: a pattern admitting a prefix does not admit the whole URL.
    (r"http://127\.0\.0\.1:{port}/ok",),
    (r"https://127\.0\.0\.1:{port}/.*",),
])
def test_a_url_allowed_urls_does_not_admit_is_forbidden_before_any_request(
        remote: Remote, model_store: Path, patterns: tuple[str, ...]) -> None:
    allowed = tuple(pattern.format(port=remote.port) for pattern in patterns)
    url = remote.url("/ok.mar")

    with pytest.raises(Forbidden, match="Admit a location with the config key allowed_urls"
                       ) as caught:
        download_archive(url, model_store, allowed, LIMIT)

    assert url in caught.value.message
    assert caught.value.http_status == 403
    assert remote.requests == []
    assert store_names(model_store) == []
    # The setting the message suggests does admit the url.
    suggested = caught.value.message.rsplit("allowed_urls=", 1)[1]
    assert download_archive(url, model_store, (suggested,), LIMIT).name == "ok.mar"


def test_an_admitted_redirect_is_followed_and_named_after_the_original_url(
        remote: Remote, model_store: Path) -> None:
    result = fetch(remote, model_store, "/redirect-ok.mar")

    assert result == model_store / "redirect-ok.mar"
    assert result.read_bytes() == OK2_BODY
    assert remote.requests == ["/redirect-ok.mar", "/ok2.mar"]
    assert store_names(model_store) == ["redirect-ok.mar"]


def test_a_redirect_allowed_urls_does_not_admit_is_forbidden_and_not_followed(
        remote: Remote, model_store: Path) -> None:
    with pytest.raises(Forbidden, match="allowed_urls does not admit") as caught:
        fetch(remote, model_store, "/redirect-out.mar")

    assert f"http://127.0.0.2:{remote.port}/ok.mar" in caught.value.message
    # 127.0.0.2 is never contacted (the server listens on 127.0.0.1 only, so a request there
    # would have failed to connect and raised ArchiveError instead).
    assert remote.requests == ["/redirect-out.mar"]
    assert store_names(model_store) == []


@pytest.mark.parametrize("path", ["/redirect-file.mar", "/redirect-ftp.mar"])
def test_a_redirect_to_another_scheme_is_refused_even_when_admitted(
        remote: Remote, model_store: Path, path: str) -> None:
    with pytest.raises(ArchiveError, match=r"only http\(s\) is followed"):
        fetch(remote, model_store, path, allowed_urls=(".*",))

    assert remote.requests == [path]
    assert store_names(model_store) == []


def test_redirects_are_followed_at_most_max_redirects_times(
        remote: Remote, model_store: Path) -> None:
    assert MAX_REDIRECTS == 5
    assert fetch(remote, model_store, "/hop-5.mar").read_bytes() == OK_BODY

    with pytest.raises(ArchiveError, match="more than 5 redirects"):
        fetch(remote, model_store, "/hop-6.mar")

    assert remote.requests[6:] == [f"/hop-{count}.mar" for count in range(6, 0, -1)]
    assert store_names(model_store) == ["hop-5.mar"]


def test_a_non_http_url_is_refused_before_any_request(
        remote: Remote, model_store: Path) -> None:
    url = f"ftp://127.0.0.1:{remote.port}/ok.mar"

    with pytest.raises(ArchiveError, match=r"only http\(s\) archives"):
        download_archive(url, model_store, (".*",), LIMIT)

    assert remote.requests == []


@pytest.mark.parametrize("path", [
    "/big.mar",
    "/huge-declared.mar",
    "/big-chunked.mar",
    "/big-close-delimited.mar",
])
def test_a_body_over_max_bytes_is_refused_and_leaves_no_partial_file(
        remote: Remote, model_store: Path, path: str) -> None:
    with pytest.raises(ArchiveError, match=f"exceeds the download limit of {LIMIT} bytes"):
        fetch(remote, model_store, path)

    assert remote.requests == [path]
    assert store_names(model_store) == []


def test_a_body_shorter_than_its_content_length_is_refused(
        remote: Remote, model_store: Path) -> None:
    with pytest.raises(ArchiveError, match="got 10 of 100 bytes"):
        fetch(remote, model_store, "/truncated.mar")

    assert store_names(model_store) == []


def test_an_existing_archive_is_a_conflict_and_is_left_unchanged(
        remote: Remote, model_store: Path) -> None:
    existing = model_store / "ok.mar"
    existing.write_bytes(b"original")

    message = "archive 'ok.mar' already exists in the model store"
    with pytest.raises(Conflict, match=re.escape(message)):
        fetch(remote, model_store, "/ok.mar")

    assert existing.read_bytes() == b"original"
    assert store_names(model_store) == ["ok.mar"]
    assert remote.requests == []


def test_an_archive_that_appears_during_the_download_is_not_replaced(
        remote: Remote, model_store: Path) -> None:
    with pytest.raises(Conflict, match="already exists"):
        fetch(remote, model_store, "/race.mar")

    assert (model_store / "race.mar").read_bytes() == b"winner"
    assert store_names(model_store) == ["race.mar"]


@pytest.mark.parametrize("path", [
    "/",
    "/ok.mar/",
    "/model.zip",
    "/model",
    "/.",
    "/a%2Fb.mar",
    "/a%5Cb.mar",
    "/a%00b.mar",
    "/.mar",
    "/.hidden.mar",
])
def test_a_url_without_a_plain_archive_name_is_refused_before_any_request(
        remote: Remote, model_store: Path, path: str) -> None:
    with pytest.raises(ArchiveError) as caught:
        fetch(remote, model_store, path, allowed_urls=(".*",))

    assert caught.value.http_status == 400
    assert remote.requests == []
    assert store_names(model_store) == []


@pytest.mark.parametrize(("path", "status"), [("/missing.mar", 404), ("/error.mar", 500)])
def test_an_http_error_names_the_status_and_the_url(
        remote: Remote, model_store: Path, path: str, status: int) -> None:
    with pytest.raises(ArchiveError, match=f"HTTP {status}") as caught:
        fetch(remote, model_store, path)

    assert remote.url(path) in caught.value.message
    assert store_names(model_store) == []


def test_a_refused_connection_is_an_archive_error(model_store: Path) -> None:
    # A bound socket that does not listen: connecting to its port is refused.
    with socket.socket() as idle:
        idle.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{idle.getsockname()[1]}/ok.mar"
        with pytest.raises(ArchiveError, match=r"cannot download.*refused"):
            download_archive(url, model_store, (".*",), LIMIT, timeout_s=5)

    assert store_names(model_store) == []


@pytest.mark.parametrize("path", ["/slow-head.mar", "/stall-body.mar"])
def test_a_stalled_server_times_out_and_leaves_no_partial_file(
        remote: Remote, model_store: Path, path: str) -> None:
    with pytest.raises(ArchiveError, match="timed out"):
        fetch(remote, model_store, path, timeout_s=SHORT_TIMEOUT_S)

    assert store_names(model_store) == []


@pytest.mark.parametrize("path", [
    "/ok/../secret/s1.mar",
    "/ok/%2e%2e/secret/s1.mar",
    "/ok/%2E./secret/s1.mar",
    "/ok/./../secret/s1.mar",
    "/ok/..%2fsecret/s1.mar",
    "/ok/..%5Csecret/s1.mar",
    "/ok/%252e%252e/secret/s1.mar",
    "/ok/..;x/secret/s1.mar",
    "/ok/sub/../../secret/s1.mar",
])
def test_a_parent_segment_in_any_spelling_is_refused_before_any_request(
        remote: Remote, model_store: Path, path: str) -> None:
    allowed = (rf"http://127\.0\.0\.1:{remote.port}/ok/.*",)

    with pytest.raises(Forbidden, match=r"'\.\.' segment") as caught:
        download_archive(remote.url(path), model_store, allowed, LIMIT)

    assert caught.value.http_status == 403
    assert remote.requests == []
    assert store_names(model_store) == []


@pytest.mark.parametrize("path", ["/ok/redirect-dotdot.mar", "/ok/redirect-encoded.mar"])
def test_a_redirect_to_a_parent_segment_is_refused_and_not_followed(
        remote: Remote, model_store: Path, path: str) -> None:
    allowed = (rf"http://127\.0\.0\.1:{remote.port}/ok/.*",)

    with pytest.raises(Forbidden, match=r"'\.\.' segment"):
        download_archive(remote.url(path), model_store, allowed, LIMIT)

    assert remote.requests == [path]
    assert store_names(model_store) == []


def test_the_normalised_url_is_what_allowed_urls_judges_and_what_is_fetched(
        remote: Remote, model_store: Path) -> None:
    allowed = (rf"http://127\.0\.0\.1:{remote.port}/ok/.*",)
    url = f"HTTP://127.0.0.1:{remote.port}/ok/./%69n.mar#fragment"

    result = download_archive(url, model_store, allowed, LIMIT)

    assert result == model_store / "in.mar"
    assert remote.requests == ["/ok/in.mar"]
    # A dot segment cannot lift a URL out of an admitted prefix, nor into one.
    with pytest.raises(Forbidden, match="allowed_urls does not admit"):
        download_archive(remote.url("/./ok.mar"), model_store, allowed, LIMIT)


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:1/ok\\..\\x.mar",
    "http://127.0.0.1:1/ok/a b.mar",
    "http://127.0.0.1:1/ok/x.mar\r\nHost: evil",
    "http://127.0.0.1:99999/ok/x.mar",
    "http:///ok/x.mar",
])
def test_urls_that_parsers_could_read_differently_are_refused(url: str) -> None:
    with pytest.raises((ArchiveError, Forbidden)):
        normalise_url(url)


@pytest.mark.parametrize(("path", "expected"), [
    ("/a/b/c/./../../g", "/a/g"),
    ("mid/content=5/../6", "mid/6"),
    ("/a/..", "/"),
    ("/a/b/.", "/a/b/"),
    ("/./a", "/a"),
    ("/", "/"),
])
def test_remove_dot_segments_follows_rfc_3986(path: str, expected: str) -> None:
    assert remove_dot_segments(path) == expected
