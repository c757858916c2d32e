"""``torchserve``'s choices that need no server: when ``--start`` stays in the foreground."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from frontend.cli import build_parser, read_state, stays_in_foreground
from frontend.errors import ConfigError

START = ["--start", "--model-store", "store"]


@pytest.mark.parametrize(("argv", "environ", "pid", "expected"), [
    (START, {}, 4242, False),  # a shell: to the background, as TorchServe
    (START, {}, 1, True),  # a container's main process must not return
    (START, {"BATCHSERVE_FOREGROUND": "1"}, 4242, True),  # the image says so (tini is PID 1)
    (START, {"BATCHSERVE_FOREGROUND": "true"}, 4242, True),
    (START, {"BATCHSERVE_FOREGROUND": "0"}, 1, False),
    ([*START, "--foreground"], {"BATCHSERVE_FOREGROUND": "false"}, 4242, True),
])
def test_start_stays_in_the_foreground_in_a_container(argv: list[str], environ: dict[str, str],
                                                       pid: int, expected: bool) -> None:
    assert stays_in_foreground(build_parser().parse_args(argv), environ, pid) is expected


def test_a_bad_foreground_value_is_refused() -> None:
    with pytest.raises(ConfigError, match="BATCHSERVE_FOREGROUND='maybe'"):
        stays_in_foreground(build_parser().parse_args(START), {"BATCHSERVE_FOREGROUND": "maybe"},
                            1)


def test_a_state_file_naming_this_process_is_stale(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted container's PID 1 finds the file its predecessor (PID 1 too) left in a
    volume: it is not "already running"."""
    monkeypatch.setenv("BATCHSERVE_STATE_DIR", str(tmp_path))
    state = tmp_path / "server.json"
    state.write_text(json.dumps({"pid": os.getpid()}))
    assert read_state() is None
    assert not state.exists()
