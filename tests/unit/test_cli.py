"""``torchserve``'s choices that need no server: when ``--start`` stays in the foreground."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from frontend.cli import build_parser, read_state, stays_in_foreground
from frontend.errors import ConfigError
from frontend.processes import python_module

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


@pytest.mark.parametrize("safe_path_flag", [True, False])  # Python 3.11's -P; 3.10's bootstrap
def test_a_module_is_run_without_the_working_directory_on_sys_path(
        tmp_path: Path, safe_path_flag: bool) -> None:
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "__init__.py").write_text("raise SystemExit('the decoy was imported')\n")
    command = python_module(sys.executable, "json.tool", safe_path_flag=safe_path_flag)
    result = subprocess.run([*command, "--compact"], input='{"a": [1]}', cwd=tmp_path,
                            capture_output=True, text=True, timeout=60, check=False)
    assert (result.returncode, result.stdout.strip()) == (0, '{"a":[1]}'), result.stderr
    unsafe = subprocess.run([sys.executable, "-m", "json.tool"], input="{}", cwd=tmp_path,
                            capture_output=True, text=True, timeout=60, check=False)
    assert "the decoy was imported" in unsafe.stderr  # what python -m does


def test_metrics_config_flag_is_the_metrics_config_key() -> None:
    from frontend.cli import cli_overrides

    args = build_parser().parse_args([*START, "--metrics-config", "m.yaml"])
    assert cli_overrides(args)["metrics_config"] == "m.yaml"
    assert "metrics_config" not in cli_overrides(build_parser().parse_args(START))
