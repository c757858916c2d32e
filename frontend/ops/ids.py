"""Request ids: random UUIDs (version 4 layout) without a system call each.

``uuid.uuid4()`` reads the kernel's random source on every call, a measurable share of the
frontend's time per request. A request id needs to be unique, not secret (it is returned to
the client in ``x-request-id``), so a pseudo-random generator seeded once from the kernel gives
the same format and the same odds of a collision.
"""

from __future__ import annotations

import os
import random

_generator = random.Random(os.urandom(32))
_getrandbits = _generator.getrandbits
# RFC 4122 layout: the version nibble is 4 and the variant bits are 10.
_CLEAR = ~((0xF << 76) | (0x3 << 62))
_SET = (0x4 << 76) | (0x2 << 62)


def new_request_id() -> str:
    """A new random id in UUID text form (8-4-4-4-12 hex digits, version 4)."""
    text = f"{(_getrandbits(128) & _CLEAR) | _SET:032x}"
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def _reseed_after_fork() -> None:
    _generator.seed(os.urandom(32))


# A forked child must not repeat its parent's ids.
os.register_at_fork(after_in_child=_reseed_after_fork)
