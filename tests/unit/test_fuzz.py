"""Property tests (hypothesis, bounded): hostile bytes and strings fail only in the ways we say.

Each parser that reads something a client or an operator wrote must fail with its own error
type, never with whatever the libraries underneath raise: the frame decoder with
ProtocolError, the config parser with ConfigError, form parsing with BadRequest, archive
unpacking with ArchiveError (and nothing written outside the target).

Inputs that hypothesis (or review) found are kept as ``@example``s, and each bug one exposed
has a test of its own below. The properties are strict: a known bug that is not fixed yet is
an ``xfail(strict=True)`` test naming it, never a tolerance inside a property.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import shutil
import stat
import tarfile
import warnings
import zipfile
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from frontend.api.http.forms import parse_form
from frontend.config import PARSERS, build_config
from frontend.errors import ArchiveError, BadRequest, ConfigError
from frontend.models.archive import unpack
from protos.framing import HEADER, MAGIC, VERSION, Frame, FrameDecoder, Kind, ProtocolError, encode

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


# ---- the frame decoder (protos/framing.py) ------------------------------------------------

frames = st.builds(Frame, st.sampled_from(list(Kind)), st.binary(max_size=300))


def _header(magic: bytes = MAGIC, version: int = VERSION, kind: int = Kind.PREDICT,
            length: int = 0) -> bytes:
    return HEADER.pack(magic, version, kind, length)


@FUZZ
@given(chunks=st.lists(st.binary(max_size=64), max_size=20))
@example(chunks=[_header(kind=0)])  # unknown kind
@example(chunks=[_header(kind=255, length=3), b"abc"])
@example(chunks=[_header(version=VERSION + 1)])
@example(chunks=[_header(magic=b"XX")])
@example(chunks=[_header(length=0xFFFFFFFF)])  # larger than MAX_PAYLOAD_BYTES
@example(chunks=[MAGIC, bytes([VERSION]), bytes([Kind.HELLO])])  # a header cut in pieces
def test_the_frame_decoder_raises_only_protocol_error(chunks: list[bytes]) -> None:
    decoder = FrameDecoder()
    for chunk in chunks:
        try:
            decoded = decoder.feed(chunk)
        except ProtocolError:
            return  # the stream cannot be resynchronised: the caller drops the connection
        assert all(isinstance(frame.kind, Kind) for frame in decoded)
    assert decoder.pending_bytes <= sum(map(len, chunks))


@FUZZ
@given(sent=st.lists(frames, max_size=8), cuts=st.lists(st.integers(0, 4000), max_size=12))
@example(sent=[Frame(Kind.SHUTDOWN)], cuts=[1, 7])
@example(sent=[Frame(Kind.PREDICT, b"x" * 300), Frame(Kind.SHUTDOWN)], cuts=[8, 308])
def test_frames_round_trip_under_any_split(sent: list[Frame], cuts: list[int]) -> None:
    stream = b"".join(encode(frame) for frame in sent)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    decoder = FrameDecoder()
    received: list[Frame] = []
    for start, end in itertools.pairwise(bounds):
        received.extend(decoder.feed(stream[start:end]))
    assert received == sent
    assert decoder.pending_bytes == 0


# ---- the config parser (frontend/config/) -------------------------------------------------

KNOWN_KEYS = sorted(PARSERS)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=4),
    max_leaves=12)
model_settings = st.dictionaries(
    st.sampled_from(["marName", "minWorkers", "maxWorkers", "batchSize", "maxBatchDelay",
                     "responseTimeout", "startupTimeout", "defaultVersion", "batchPolicy",
                     "unknownKey"]),
    json_values, max_size=4)
models_json = st.dictionaries(
    st.text(max_size=8), st.dictionaries(st.text(max_size=5), model_settings | json_values,
                                         max_size=2), max_size=2).map(json.dumps)
config_values = st.text(max_size=40) | models_json | json_values.map(json.dumps)

# Found by review and hypothesis (each has its own test below):
MODELS_OVERFLOW = '{"m": {"1.0": {"batchSize": 1e400}}}'
REGEX_OVERFLOW = "a{4294967296}"
DEEP_JSON = "[" * 100_000


@FUZZ
@given(entries=st.dictionaries(st.sampled_from(KNOWN_KEYS), config_values, max_size=4))
@example(entries={"inference_address": "http://[::1"})
@example(entries={"inference_address": "https://127.0.0.1:8443"})
@example(entries={"grpc_inference_port": "70000"})
@example(entries={"max_request_size": "9" * 5000})  # past int()'s digit limit
@example(entries={"allowed_urls": "(?"})
@example(entries={"models": "[]"})
@example(entries={"models": '{"m": {"1.0": {"batchSize": "x"}}}'})
@example(entries={"models": '{"m": {"1.0": {"batchSize": NaN}}}'})
@example(entries={"models": MODELS_OVERFLOW})
@example(entries={"allowed_urls": REGEX_OVERFLOW})
@example(entries={"models": DEEP_JSON})
@example(entries={"model_snapshot": DEEP_JSON})
@example(entries={"metrics_mode": "bogus"})
@example(entries={"allowed_urls": "[["})  # re warns (FutureWarning): a warning, not an error
def test_the_config_parser_raises_only_config_error(entries: dict[str, str]) -> None:
    try:
        with warnings.catch_warnings():
            # The suite turns warnings into errors; a running server only logs them.
            warnings.simplefilter("ignore", FutureWarning)
            build_config(entries)
    except ConfigError:
        pass


def test_a_huge_number_in_models_json_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="batchSize"):
        build_config({"models": MODELS_OVERFLOW})


def test_a_huge_repeat_count_in_allowed_urls_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="allowed_urls"):
        build_config({"allowed_urls": REGEX_OVERFLOW})


@pytest.mark.parametrize("key", ["models", "model_snapshot"])
def test_deeply_nested_json_is_a_config_error(key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        build_config({key: DEEP_JSON})


def test_default_version_false_as_a_string_is_false() -> None:
    config, _ = build_config({"models": '{"m": {"1.0": {"defaultVersion": "false"}}}'})
    assert config.models["m"]["1.0"].is_default_version is False


# ---- form bodies (frontend/api/http/forms.py) -------------------------------------------------

# The server decodes header values as latin-1, so a content type is always latin-1 text.
latin1 = st.text(st.characters(max_codepoint=0xFF), max_size=40)
content_types = (
    latin1
    | latin1.map(lambda b: f"multipart/form-data; boundary={b}")
    | st.just("multipart/form-data; boundary=XyZ")
    | st.just("application/x-www-form-urlencoded")
    | st.just("multipart/form-data"))
PART = (b'--XyZ\r\nContent-Disposition: form-data; name="data"; filename="a.bin"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\nPAYLOAD\r\n")
LONG_BOUNDARY = "multipart/form-data; boundary=" + "b" * 500
bodies = (st.binary(max_size=200)
          | st.lists(st.sampled_from([PART, b"--XyZ--\r\n", b"--XyZ\r\n", b"\r\n\r\n",
                                      b"Content-Disposition: form-data\r\n", b"\xff\x00",
                                      b"name=a&b=%zz&=", b"--", b"XyZ"]),
                     max_size=6).map(b"".join))


@FUZZ
@given(content_type=content_types, body=bodies)
@example(content_type="multipart/form-data", body=PART)  # no boundary
@example(content_type='multipart/form-data; boundary=""', body=b"")
@example(content_type="multipart/form-data; boundary=XyZ", body=b"garbage")
@example(content_type="multipart/form-data; boundary=XyZ",
         body=b"--XyZ\r\nContent-Disposition: form-data\r\n\r\nx\r\n--XyZ--\r\n")  # no name
@example(content_type="multipart/form-data; boundary=XyZ",
         body=b"--XyZ\r\nbad header\r\n\r\nx\r\n--XyZ--\r\n")
@example(content_type=LONG_BOUNDARY, body=b"--")
@example(content_type="multipart/form-data; boundary=\xff", body=b"--\xff\r\n")
@example(content_type="application/x-www-form-urlencoded", body=b"\xff%zz&&=x")
def test_form_parsing_raises_only_bad_request(content_type: str, body: bytes) -> None:
    try:
        fields = parse_form(content_type, body, 1000)
    except BadRequest:
        return
    for name, data, field_type in fields:
        assert isinstance(name, str) and isinstance(data, bytes) and isinstance(field_type, str)


def test_a_well_formed_multipart_body_is_split_into_its_fields() -> None:
    fields = parse_form("multipart/form-data; boundary=XyZ", PART + b"--XyZ--\r\n", 1000)
    assert fields == [("data", b"PAYLOAD", "application/octet-stream")]


def test_an_overlong_boundary_is_a_bad_request() -> None:
    with pytest.raises(BadRequest):
        parse_form(LONG_BOUNDARY, b"--", 1000)


@pytest.mark.parametrize("body", [PART[:-4], PART, b""], ids=["mid-part", "no-close", "empty"])
def test_a_truncated_multipart_body_is_a_bad_request(body: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_form("multipart/form-data; boundary=XyZ", body, 1000)


# ---- archive members (frontend/models/archive.py) ------------------------------------------------
#
# Archives are unpacked into <sandbox>/a/b/c/work/<name>-<id>/; every escaping name used here
# points into <sandbox> (at most five '..', absolute paths under <sandbox>), so a failure of
# the checks shows up as a new file in the sandbox rather than anywhere else on the machine.

DEPTH = 5
SENTINEL = "escaped.txt"


def _sandbox(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    sandbox = tmp_path_factory.mktemp("sandbox")
    work = sandbox / "a" / "b" / "c" / "work"
    work.mkdir(parents=True)
    return sandbox, work


def _tree(root: Path, skip: Path) -> set[str]:
    found = set()
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == skip:
            dirnames.clear()
            continue
        found.update(os.path.join(dirpath, name) for name in dirnames + filenames)
    return found


def member_names(sandbox: Path) -> st.SearchStrategy[str]:
    parts = st.sampled_from(["..", ".", "a", "MAR-INF", SENTINEL, "", "\\..", "..\\.."])
    relative = st.lists(parts, min_size=1, max_size=DEPTH + 2).map("/".join)
    return (relative
            | relative.map(lambda name: f"{sandbox}/{name}")  # absolute
            | relative.map(lambda name: f"\\{name}")
            | st.just(f"{'../' * DEPTH}{SENTINEL}")
            | st.text(max_size=12))


def _zip(path: Path, members: list[tuple[str, str | None]]) -> None:
    """``(name, None)``: a file; ``(name, target)``: a symbolic link to ``target``."""
    with zipfile.ZipFile(path, "w") as archive, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # duplicate names are part of the fuzz
        for name, link in members:
            info = zipfile.ZipInfo(name)
            if link is None:
                archive.writestr(info, b"payload")
            else:
                info.external_attr = (stat.S_IFLNK | 0o777) << 16
                archive.writestr(info, link.encode())


def _tar(path: Path, members: list[tuple[str, str | None]], hard: bool) -> None:
    with tarfile.open(path, "w:gz") as archive:
        for name, link in members:
            info = tarfile.TarInfo(name)
            if link is None:
                info.size = 7
                archive.addfile(info, io.BytesIO(b"payload"))
            else:
                info.type = tarfile.LNKTYPE if hard else tarfile.SYMTYPE
                info.linkname = link
                archive.addfile(info)


def _is_hostile(members: list[tuple[str, str | None]]) -> bool:
    """Whether some member is a link, absolute, climbs with '..' or starts with a backslash
    (zip names end at a NUL byte, as zipfile reads them)."""
    for name, link in members:
        name = name.split("\x00", 1)[0]
        path = PurePosixPath(name)
        if link is not None or path.is_absolute() or ".." in path.parts or name.startswith("\\"):
            return True
    return False


def _assert_safe_unpack(archive: Path, work: Path, sandbox: Path,
                        members: list[tuple[str, str | None]]) -> None:
    before = _tree(sandbox, work)
    hostile = _is_hostile(members)
    try:
        unpacked = unpack(archive.name, archive, work)
    except ArchiveError:
        assert not any(work.iterdir()), "a refused archive left its extraction behind"
    else:
        assert not hostile, f"unpack accepted hostile members {members!r}"
        model_dir = unpacked.model_dir.resolve()
        for path in model_dir.rglob("*"):
            assert not path.is_symlink(), path
            assert model_dir in path.resolve().parents, path
    finally:
        for child in work.iterdir():
            shutil.rmtree(child)
    assert _tree(sandbox, work) == before, "unpack wrote outside its target"


hostile = st.data()


@FUZZ
@given(data=hostile)
def test_zip_members_never_escape_and_fail_with_archive_error(
        data: st.DataObject, tmp_path_factory: pytest.TempPathFactory) -> None:
    sandbox, work = _sandbox(tmp_path_factory)
    names = member_names(sandbox)
    links = st.none() | st.sampled_from([str(sandbox), "..", f"{'../' * DEPTH}", "/etc", "."])
    members = data.draw(st.lists(st.tuples(names, links), min_size=1, max_size=4))
    archive = sandbox / "hostile.mar"
    _zip(archive, members)
    _assert_safe_unpack(archive, work, sandbox, members)


@FUZZ
@given(data=hostile, hard=st.booleans())
def test_tar_members_never_escape_and_fail_with_archive_error(
        data: st.DataObject, hard: bool, tmp_path_factory: pytest.TempPathFactory) -> None:
    sandbox, work = _sandbox(tmp_path_factory)
    names = member_names(sandbox).filter(lambda n: "\x00" not in n)
    links = st.none() | st.sampled_from([str(sandbox), "..", f"{'../' * DEPTH}", "/etc", "."])
    members = data.draw(st.lists(st.tuples(names, links), min_size=1, max_size=4))
    archive = sandbox / "hostile.tar.gz"
    _tar(archive, members, hard)
    _assert_safe_unpack(archive, work, sandbox, members)


@pytest.mark.parametrize("members", [
    [(f"{'../' * DEPTH}{SENTINEL}", None)],
    [("../evil.py", None)],
    [("MAR-INF/../../evil.py", None)],
    [("/abs/evil.py", None)],
    [("\\evil.py", None)],
    [("link", "/etc")],
    [("link", "..")],
    [("link", "."), ("link/evil.py", None)],
], ids=["deep-dotdot", "dotdot", "inner-dotdot", "absolute", "backslash", "link-abs",
        "link-up", "through-link"])
@pytest.mark.parametrize("fmt", ["mar", "tar.gz", "tar.gz-hardlink"])
def test_known_zip_slip_shapes_are_refused(
        members: list[tuple[str, str | None]], fmt: str,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    sandbox, work = _sandbox(tmp_path_factory)
    if fmt == "mar":
        archive = sandbox / "evil.mar"
        _zip(archive, members)
    else:
        archive = sandbox / "evil.tar.gz"
        _tar(archive, members, hard=fmt.endswith("hardlink"))
    before = _tree(sandbox, work)
    with pytest.raises(ArchiveError):
        unpack(archive.name, archive, work)
    assert not any(work.iterdir())
    assert _tree(sandbox, work) == before


# Found by hypothesis: a file and a directory of the same name, an empty name, a name past the
# file system's limit (each once raised an OSError or IndexError instead of ArchiveError).
MALFORMED_MEMBERS = [[("a", None), ("a/b", None)], [("a/b", None), ("a", None)], [("", None)],
                     [("x" * 300, None)]]


@pytest.mark.parametrize("members", MALFORMED_MEMBERS,
                         ids=["file-then-dir", "dir-then-file", "empty-name", "name-too-long"])
def test_malformed_zip_members_are_an_archive_error(
        members: list[tuple[str, str | None]], tmp_path: Path) -> None:
    archive = tmp_path / "odd.mar"
    _zip(archive, members)
    (tmp_path / "work").mkdir()
    with pytest.raises(ArchiveError):
        unpack(archive.name, archive, tmp_path / "work")
