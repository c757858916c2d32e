"""The images' contract checks themselves (docker/contract.py): each passes on what the
contract promises and fails on what would break it, and the log layout they read is the one
TorchServe's and the SageMaker toolkit's log4j2 files give (the layout log parsers read)."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from docker.contract import (
    TS_LOG_LINE,
    TS_LOG_PATTERN,
    Process,
    image_command,
    image_env,
    parse_processes,
    server_and_workers,
    server_log,
    subtree,
)
from tests.integration.test_torchserve_logs import line_regex, torchserve_patterns

REPO = Path(__file__).resolve().parents[2]
TOOLKIT_LOG4J = next((REPO / ".venv-sagemaker" / "lib").glob(
    "python3*/site-packages/sagemaker_pytorch_serving_container/etc/log4j2.xml"), None)

SERVER = "/opt/batchserve/bin/python3 /opt/batchserve/bin/torchserve --start --foreground "
FORKSERVER = "/opt/batchserve/bin/python3 -P -m backend.process.forkserver "
#: A container as the KServe image runs: the server PID 1, its fork server, two workers
#: forked from it, the listing's own shell (podman exec: no parent in the container).
CONTAINER = [Process(1, 0, 1000, SERVER), Process(8, 1, 1000, FORKSERVER),
             Process(10, 8, 1000, FORKSERVER), Process(11, 8, 1000, FORKSERVER),
             Process(40, 0, 1000, "sh -c for p in /proc/[0-9]*; ...")]


def test_the_listing_parses_and_skips_a_process_that_ended_meanwhile() -> None:
    listing = "1 0 1000 torchserve --start \n7  \n8 1 1000 python -P -m backend.x \n"
    assert parse_processes(listing) == [Process(1, 0, 1000, "torchserve --start "),
                                        Process(8, 1, 1000, "python -P -m backend.x ")]
    assert [p.pid for p in subtree(CONTAINER, 8)] == [8, 10, 11]


def test_workers_forked_by_the_fork_server_are_the_servers() -> None:
    ok, detail = server_and_workers(CONTAINER, 1, 1000, [10, 11], alone=True)
    assert ok, detail
    assert "parents [8]" in detail


@pytest.mark.parametrize(("processes", "workers", "why"), [
    # A worker that is not the server's (its parent is outside the server's tree).
    ([*CONTAINER[:3], Process(11, 40, 1000, FORKSERVER), CONTAINER[4]], [10, 11], "missing"),
    # A worker process in the container that describe does not name, and not the server's.
    ([*CONTAINER, Process(50, 0, 1000, FORKSERVER)], [10, 11], "stray"),
    # A process of the server's that runs as root.
    ([*CONTAINER[:3], Process(11, 8, 0, FORKSERVER), CONTAINER[4]], [10, 11], "uid"),
    # PID 1 is not the server (a shell that started it, say).
    ([Process(1, 0, 1000, "/bin/sh -c torchserve-wrapper"), *CONTAINER[1:]], [10, 11], "pid 1"),
    # Describe names no worker.
    (CONTAINER, [], "no workers"),
])
def test_the_process_check_fails_when_the_contract_breaks(
        processes: list[Process], workers: list[int], why: str) -> None:
    ok, detail = server_and_workers(processes, 1, 1000, workers, alone=True)
    assert not ok, (why, detail)


def test_outside_a_container_other_servers_workers_are_not_asked_about() -> None:
    others = [*CONTAINER, Process(50, 0, 1000, FORKSERVER)]
    assert server_and_workers(others, 1, 1000, [10, 11], alone=False)[0]


LINES = [
    "2026-11-27T18:34:30,079 [INFO ] MainThread frontend.serving.forkserver - fork server up",
    "2026-11-27T18:34:30,118 [INFO ] W-9000-model_1.0-stdout MODEL_LOG - anything at all",
    "2026-11-27T18:34:33,500 [WARN ] MainThread frontend.server - whatever it says",
]


@pytest.mark.parametrize(("ts_log", "console", "passes"), [
    (LINES, ["the toolkit's own line", *LINES], True),
    # A line of the file in another layout.
    ([*LINES, "18:34:33 INFO frontend.server: stopped"], LINES, False),
    # No line of the model's worker (its stdout, under TorchServe's thread name).
    ([LINES[0], LINES[2]], LINES, False),
    ([line.replace("W-9000-model_1.0-stdout", "worker-1") for line in LINES], LINES, False),
    # A line of the file that is not on the console.
    (LINES, LINES[:2], False),
    # No log at all.
    ([], [], False),
])
def test_the_log_check_reads_the_layout_not_the_words(
        ts_log: list[str], console: list[str], passes: bool) -> None:
    ok, detail = server_log(lambda: "\n".join(console), lambda: "\n".join(ts_log), "model",
                            timeout_s=0)()
    assert ok is passes, detail


def test_the_log_layout_is_torchserves_and_the_sagemaker_toolkits() -> None:
    # TorchServe's ts_log.log (its log4j2.xml, held by tests/integration/test_torchserve_logs).
    assert torchserve_patterns()["ts_log.log"] == TS_LOG_PATTERN
    # The contract's regular expression reads a line as that layout's does.
    theirs = line_regex(TS_LOG_PATTERN)
    for line in [*LINES, "18:34:33 INFO frontend.server: stopped", LINES[0][:30],
                 LINES[1].replace("[INFO ]", "[INFO]"), LINES[2] + " - with - dashes"]:
        ours, expected = TS_LOG_LINE.fullmatch(line), theirs.fullmatch(line)
        assert (ours and ours.groupdict()) == (expected and expected.groupdict()), line
    if TOOLKIT_LOG4J is None:
        pytest.skip("the SageMaker toolkit's venv (.venv-sagemaker, made by `make test`) is "
                    "missing: its log4j2.xml could not be read")
    # The toolkit's: the console (the container's log, sent to CloudWatch) and ts_log.log.
    root = ElementTree.parse(TOOLKIT_LOG4J).getroot()
    layouts = {appender.attrib["name"]: appender.find("PatternLayout")
               for appender in root.iter() if appender.tag in ("Console", "RollingFile")}
    assert {name: layout.attrib["pattern"] for name, layout in layouts.items()
            if name in ("STDOUT", "ts_log") and layout is not None} == {
        "STDOUT": TS_LOG_PATTERN, "ts_log": TS_LOG_PATTERN}


def test_the_images_env_and_command_read_from_the_recipe(tmp_path: Path) -> None:
    recipe = tmp_path / "Dockerfile"
    recipe.write_text('FROM x\nENV PATH=/opt/v/bin:/usr/bin \\\n    A=1 \\\n    B="two words"\n'
                      'CMD ["torchserve", "--start"]\n')
    assert image_env(recipe) == {"A": "1", "B": "two words"}
    assert image_command(recipe) == ["torchserve", "--start"]
