r"""``torchserve --start --log-config log4j2.xml`` in the background, as SageMaker's toolkit
starts it: the server's log is the command's own output (the file's console appender) and
ts_log.log, access_log.log and model_log.log are where the file says (a lookup of the
environment, relative to the working directory), each line escaped."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import requests

BIN = Path(sys.executable).parent
FORGED = "\r\n2024-01-01T00:00:00,000 [INFO ] main FORGED - \x1b[2J"
#: TorchServe's server log line: %d{ISO8601} [%-5p] %t %c - %m
LINE = re.compile(r"20\d\d-\d\d-\d\dT\d\d:\d\d:\d\d,\d{3} \[[A-Z]+ *\] \S+ \S+ - .*")

LOG4J2 = """<?xml version="1.0" encoding="UTF-8"?>
<Configuration>
  <Appenders>
    <Console name="STDOUT" target="SYSTEM_OUT">
      <PatternLayout pattern="%d{ISO8601} [%-5p] %t %c - %m%n"/>
    </Console>
    <RollingFile name="ts_log" fileName="${env:LOG_LOCATION:-logs}/ts_log.log"
                 filePattern="${env:LOG_LOCATION:-logs}/ts_log.%d{dd-MMM}.log.gz">
      <PatternLayout pattern="%d{ISO8601} [%-5p] %t %c - %m%n"/>
      <Policies><SizeBasedTriggeringPolicy size="10 MB"/></Policies>
      <DefaultRolloverStrategy max="5"/>
    </RollingFile>
    <File name="access_log" fileName="${env:LOG_LOCATION:-logs}/access_log.log">
      <PatternLayout pattern="%d{ISO8601} - %m%n"/>
    </File>
    <File name="model_log" fileName="${env:LOG_LOCATION:-logs}/model_log.log">
      <PatternLayout pattern="%d{ISO8601} [%-5p] %c - %m%n"/>
    </File>
  </Appenders>
  <Loggers>
    <Logger name="ACCESS_LOG" level="info" additivity="false">
      <AppenderRef ref="access_log"/>
    </Logger>
    <Logger name="MODEL_LOG" level="info"><AppenderRef ref="model_log"/></Logger>
    <Logger name="org.pytorch.serve" level="info" additivity="false">
      <AppenderRef ref="STDOUT"/><AppenderRef ref="ts_log"/>
    </Logger>
    <Root level="warn"><AppenderRef ref="STDOUT"/></Root>
  </Loggers>
</Configuration>
"""


def test_background_start_writes_the_logs_its_log4j2_file_names(
        tmp_path: Path, build_mar: Callable[..., Path], model_store: Path) -> None:
    build_mar("printer", "printer")
    work = tmp_path / "work"
    work.mkdir()
    (work / "log4j2.xml").write_text(LOG4J2)
    (work / "config.properties").write_text(
        "inference_address=http://127.0.0.1:0\nmanagement_address=http://127.0.0.1:0\n"
        "metrics_address=http://127.0.0.1:0\ngrpc_inference_port=0\ngrpc_management_port=0\n"
        "default_workers_per_model=1\nlog_location=ours\n")
    env = {**os.environ, "BATCHSERVE_STATE_DIR": str(tmp_path / "state"),
           "LOG_LOCATION": "xml-logs"}
    out = work / "out.txt"
    with out.open("wb") as output:  # not a pipe: the server keeps writing to it
        started = subprocess.run(
            [str(BIN / "torchserve"), "--start", "--model-store", str(model_store),
             "--models", "printer.mar", "--ts-config", "config.properties",
             "--disable-token-auth", "--log-config", "log4j2.xml"],
            cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=output,
            stderr=subprocess.STDOUT, timeout=120)
    try:
        assert started.returncode == 0, out.read_text()
        state = json.loads((tmp_path / "state" / "server.json").read_text())
        printed = requests.post(f"{state['inference']}/predictions/printer",
                                data=f"hello{FORGED}".encode(), timeout=30)
        assert printed.status_code == 200
        missing = requests.post(
            f"{state['inference']}/predictions/none{urllib.parse.quote(FORGED)}", timeout=30)
        assert missing.status_code == 404

        logs = work / "xml-logs"
        access, model_log, ts_log = (logs / name for name in (
            "access_log.log", "model_log.log", "ts_log.log"))
        _wait(lambda: access.read_text().count("\n") >= 2, "the access log's lines")
        _wait(lambda: "logged: hello" in model_log.read_text(), "the handler's log line")
    finally:
        stopped = subprocess.run([str(BIN / "torchserve"), "--stop"], cwd=work, env=env,
                                 capture_output=True, text=True, timeout=240)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr

    # The server's log, on the command's output (the console appender) and in ts_log.log.
    output_lines = out.read_text().splitlines()
    server_lines = [line for line in output_lines if LINE.fullmatch(line)]
    assert any(" frontend.server - inference API on http://127.0.0.1:" in line
               for line in server_lines), output_lines
    assert any(line.endswith("frontend.server - stopped") for line in server_lines)
    assert "frontend.server - inference API on" in ts_log.read_text()
    assert all(LINE.fullmatch(line) for line in ts_log.read_text().splitlines())
    # Where the file says, not in log_location: no server log, no access log of ours.
    assert not (work / "ours" / "access_log.log").exists()
    assert not (work / "ours" / "ts_log.log").exists()
    assert not (work / "logs").exists()

    # Each log keeps one line per entry: the client's bytes are escaped.
    for path in (access, model_log, ts_log, out):
        text = path.read_text()
        assert "\r" not in text and "\x1b" not in text, path.name
        assert not any(line.startswith("2024-01-01") for line in text.splitlines())
    # TorchServe's access line: the request line's target as the client sent it.
    target = re.escape(f"/predictions/none{urllib.parse.quote(FORGED)}")
    assert re.search(rf'^\S+ - /127\.0\.0\.1:\d+ "POST {target} HTTP/1\.1" 404 \d+$',
                     access.read_text(), re.M), access.read_text()
    # What the handler logs stays on its line (a line it prints is two lines of output).
    assert re.search(r"^\S+ \[INFO \] MODEL_LOG - logged: hello\\r"
                     r"\\n2024-01-01T00:00:00,000 \[INFO \] main FORGED - \\x1b\[2J$",
                     model_log.read_text(), re.M), model_log.read_text()
    # Additivity: MODEL_LOG's lines also reach Root's console, on the thread named as
    # TorchServe's reader thread of the worker's stdout; ACCESS_LOG's (off) do not.
    assert any(re.search(r" W-\d+-printer_1\.0-stdout MODEL_LOG - printed: hello", line)
               for line in output_lines), output_lines
    assert not any("POST /predictions/printer" in line for line in output_lines)


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
