"""The pure parts of the front processes: the link's frames, where a pipelined request begins
in a read, and number_of_netty_threads' default."""

from __future__ import annotations

import marshal
import struct
from pathlib import Path

import pytest

from frontend.api.http.linked import REQUEST, FrameReader
from frontend.config import default_fronts, load_config, netty_fronts, usable_cores
from frontend.errors import ConfigError
from frontend.front.splice import message_start


def _frame(message: tuple[object, ...]) -> bytes:
    data = marshal.dumps(message)
    return struct.pack("<I", len(data)) + data


def test_frames_are_read_whole_whatever_the_reads() -> None:
    messages = [(REQUEST, i, "/1.2.3.4:5", "POST", b"/predictions/m", "1.1",
                 [(b"a", b"b")], b"x" * (i * 1000)) for i in range(5)]
    stream = b"".join(_frame(m) for m in messages)
    for size in (1, 7, 4096, len(stream)):
        reader, got = FrameReader(), []
        for start in range(0, len(stream), size):
            got += reader.feed(stream[start:start + size])
        assert got == messages, size


def test_a_pipelined_request_is_found_where_it_begins() -> None:
    first = b"POST /predictions/m HTTP/1.1\r\ncontent-length: 5\r\n\r\nhello"
    second = b"GET /ping HTTP/1.1\r\n\r\n"
    third = b"POST /x HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    window = first + second + third
    assert message_start(window, 1) == len(first)
    assert message_start(window, 2) == len(first) + len(second)
    assert message_start(window + b"GET / HTTP/1.1\r\n", 3) == len(window)


@pytest.mark.parametrize(("cores", "processes"), [(1, 1), (2, 1), (4, 1), (8, 2), (16, 4),
                                                  (32, 8), (128, 8)])
def test_the_default_gives_a_laptop_one_process_and_a_big_host_several(
        cores: int, processes: int) -> None:
    assert default_fronts(cores) == processes


@pytest.mark.parametrize(("threads", "cores", "processes"), [
    (1, 16, 1), (2, 2, 1), (4, 2, 1), (4, 3, 1), (2, 4, 2), (4, 4, 2), (4, 16, 4),
    (32, 16, 8), (64, 128, 64), (3, 1, 1)])
def test_netty_threads_become_processes_the_cores_can_feed(
        threads: int, cores: int, processes: int) -> None:
    assert netty_fronts(threads, cores) == processes


def test_the_key_and_its_variable_are_read_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "config.properties"
    path.write_text("number_of_netty_threads=3\n")
    config = load_config(path, {}, environ={})
    assert config.number_of_netty_threads == 3
    assert config.frontend_processes == netty_fronts(3) == min(3, max(1, usable_cores() // 2))
    path.write_text("enable_envvars_config=true\n")
    config = load_config(path, {}, environ={"TS_NUMBER_OF_NETTY_THREADS": "5"})
    assert config.number_of_netty_threads == 5 and config.frontend_processes == netty_fronts(5)
    for bad in ("0", "65", "two"):
        path.write_text(f"number_of_netty_threads={bad}\n")
        with pytest.raises(ConfigError, match=r"number_of_netty_threads.*\[1, 64\]|number_of"):
            load_config(path, {}, environ={})


def test_frontend_processes_is_exact_and_wins(tmp_path: Path) -> None:
    path = tmp_path / "config.properties"
    path.write_text("number_of_netty_threads=1\nfrontend_processes=3\n")
    assert load_config(path, {}, environ={}).frontend_processes == 3
    path.write_text("frontend_processes=65\n")
    with pytest.raises(ConfigError, match="frontend_processes"):
        load_config(path, {}, environ={})
