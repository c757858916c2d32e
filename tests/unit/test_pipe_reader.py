"""A worker's output pipe read by the frontend (frontend/serving/forkserver.py's
``_pipe_reader``): its descriptor is closed once, by one owner, on uvloop and on asyncio's own
loop alike. (uvloop closes a read pipe through libuv and then closes the file object it was
given too; if that object owned the descriptor, the second close would hit whatever another
thread opened under the same number in between: a test client's socket got EBADF so.)"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from frontend.serving import forkserver


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


async def _read_to_the_end() -> tuple[bytes, int, Any]:
    loop = asyncio.get_running_loop()
    given: list[Any] = []
    connect = loop.connect_read_pipe

    async def spying(factory: Any, pipe: Any) -> Any:
        given.append(pipe)
        return await connect(factory, pipe)

    loop.connect_read_pipe = spying  # type: ignore[method-assign]
    read_end, write_end = os.pipe()
    os.write(write_end, b"hello\nworld\n")
    os.close(write_end)
    reader = await forkserver._pipe_reader(read_end)
    data = await reader.read()
    for _ in range(100):  # the transport closes a turn or two after end of file
        if _closed(read_end):
            break
        await asyncio.sleep(0.01)
    return data, read_end, given[0]


@pytest.mark.parametrize("run", [uvloop.run, asyncio.run], ids=["uvloop", "asyncio"])
def test_the_pipe_is_read_whole_and_its_descriptor_closed_by_one_owner(
        run: Callable[[Coroutine[Any, Any, tuple[bytes, int, Any]]],
                      tuple[bytes, int, Any]]) -> None:
    data, fd, pipe = run(_read_to_the_end())
    assert data == b"hello\nworld\n"
    assert _closed(fd)  # nothing leaks
    # Under uvloop libuv owns the descriptor, so the file object must not close it again.
    assert pipe.closefd is (run is asyncio.run)
