"""Request ids: the UUID text form, unique, and not repeated by a forked child."""

from __future__ import annotations

import os
import uuid

from frontend.ops.ids import new_request_id


def test_request_ids_are_unique_version_4_uuids_also_after_a_fork() -> None:
    ids = [new_request_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(uuid.UUID(text).version == 4 and str(uuid.UUID(text)) == text for text in ids)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child sends its next id; it must not be the parent's next one
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    from_child = os.read(read, 64).decode()
    os.close(read)
    assert from_child != new_request_id()
