"""glibc's allocator set for what a frontend process allocates: request bodies and batch frames
of tens of KB to a few MB, made and freed thousands of times a second.

By default glibc gives a block over 128 KB (``M_MMAP_THRESHOLD``, raised only once such a block
is freed) a mapping of its own, and hands the heap's free top back to the kernel past 128 KB
(``M_TRIM_THRESHOLD``): each batch of 64 KB JPEG uploads then maps, faults in and unmaps its
memory again, or grows and trims the heap, several times. That was most of the frontend's
time on uploads (a batch of eight written in ~510 µs, ~60 µs once blocks up to 4 MiB stay in
the heap and 16 MiB of its free top is kept). The settings below are glibc's own
(``mallopt``); the price is up to ``TRIM_THRESHOLD_BYTES`` of freed memory kept after a
burst. A user who sets glibc's ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_``
keeps theirs, and nothing is changed elsewhere than glibc. Workers are left as they are:
their memory is the model's.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)

#: mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Blocks up to this size come from the heap.
MMAP_THRESHOLD_BYTES = 4 << 20
#: The heap's free top kept, at most.
TRIM_THRESHOLD_BYTES = 16 << 20
#: glibc's variables for the same settings: when one is set, the user chose.
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
USER_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")


def tune_allocator() -> bool:
    """Set this process's thresholds (see the module docstring). False when left alone: not
    glibc, or the user set them."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if (any(name in os.environ for name in USER_SETTINGS)
            or any(name in tunables for name in USER_TUNABLES)
            or platform.libc_ver()[0] != "glibc"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done: bool = (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
                  and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if not done:
        logger.debug("mallopt refused the frontend's thresholds")
    return done
