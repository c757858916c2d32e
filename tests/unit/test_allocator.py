"""The frontend's allocator settings (frontend/allocator.py), in fresh interpreters: a request
body's worth of memory stays in the heap, and a user's own glibc settings win."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")

#: Prints whether it tuned, and how many blocks glibc mapped of their own (mallinfo2's hblks)
#: while a 1 MiB body is held.
PROBE = """
import ctypes
from frontend.allocator import tune_allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
tuned = tune_allocator()
before = mallinfo2().hblks
body = bytes(1 << 20)
print(tuned, mallinfo2().hblks - before)
"""


def _probe(**env: str) -> list[str]:
    clean = {key: value for key, value in os.environ.items()
             if not key.startswith("MALLOC_") and key != "GLIBC_TUNABLES"}
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          check=True, env={**clean, **env}, timeout=60).stdout.split()


def test_a_body_stays_in_the_heap() -> None:
    assert _probe() == ["True", "0"]


@pytest.mark.parametrize("setting", [{"MALLOC_TRIM_THRESHOLD_": "131072"},
                                     {"MALLOC_MMAP_THRESHOLD_": "131072"},
                                     {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}])
def test_the_users_own_settings_are_kept(setting: dict[str, str]) -> None:
    assert _probe(**setting) == ["False", "1"]
