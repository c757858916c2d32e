"""The log files of a real server after real traffic, read with TorchServe's own line patterns
(issue 31, item 9): a parser or dashboard written for TorchServe's logs reads ours.

The patterns come from TorchServe 0.12's log4j2.xml (in its wheel, which ``make test``
installs, else its sources; else the same patterns as written here), one per file, and the
access log's message is TorchServe's ``Session`` line. A change of a file's name or of a
line's wording fails here."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import requests

from protos import inference_pb2, inference_pb2_grpc, management_pb2, management_pb2_grpc
from tests.conftest import spawn_server
from tests.unit.test_log4j import torchserve_default

BIN = Path(sys.executable).parent
#: TorchServe 0.12's appenders' files and layouts (its log4j2.xml), where that file is not on
#: this machine.
TORCHSERVE_PATTERNS = {
    "access_log.log": "%d{ISO8601} - %m%n",
    "model_log.log": "%d{ISO8601} [%-5p] %t %c - %m%n",
    "model_metrics.log": "%d{ISO8601} - %m%n",
    "ts_log.log": "%d{ISO8601} [%-5p] %t %c - %m%n",
    "ts_metrics.log": "%d{ISO8601} - %m%n",
}
#: The regular expression of each conversion TorchServe's patterns use.
_CONVERSIONS = {
    "%d{ISO8601}": r"(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d{3})",
    "%-5p": r"(?P<level>TRACE|DEBUG|INFO |WARN |ERROR|FATAL)",
    "%t": r"(?P<thread>\S+)",
    "%c": r"(?P<logger>\S+)",
    "%m": r"(?P<message>.*)",
}
#: TorchServe's access-log message (Session.toString): client, request line, status, ms.
ACCESS_MESSAGE = re.compile(r'(?P<client>/\S+) "(?P<method>[A-Z]+|gRPC) (?P<uri>\S+) '
                            r'(?P<protocol>HTTP/\d\.\d)" (?P<status>\d+) (?P<ms>\d+)')
#: TorchServe's metric line (LogMetric): name.unit:value|#dimensions|#hostname:...
METRIC_MESSAGE = re.compile(r"\w+\.\w+:[-\d.eE+]+\|#.*\|#hostname:\S+,timestamp:\d+.*")
INFERENCE = "org.pytorch.serve.grpc.inference.InferenceAPIsService"
MANAGEMENT = "org.pytorch.serve.grpc.management.ManagementAPIsService"


def torchserve_patterns() -> dict[str, str]:
    """Each log file's name and PatternLayout, from TorchServe's own log4j2.xml."""
    source = torchserve_default()
    if source is None:
        return TORCHSERVE_PATTERNS
    patterns = {}
    for appender in ElementTree.fromstring(source).iter("RollingFile"):
        layout = appender.find("PatternLayout")
        assert layout is not None
        patterns[appender.attrib["fileName"].rpartition("/")[2]] = layout.attrib["pattern"]
    assert patterns == TORCHSERVE_PATTERNS  # the fallback says what the file says
    return patterns


def line_regex(pattern: str) -> re.Pattern[str]:
    """A log4j2 pattern of TorchServe's as a regular expression for one line."""
    assert pattern.endswith("%n")
    parts = re.split(r"(%d\{ISO8601\}|%-5p|%t|%c|%m)", pattern[:-2])
    assert not any("%" in part for part in parts[::2]), f"a conversion not known: {pattern}"
    return re.compile("".join(_CONVERSIONS.get(part, re.escape(part)) for part in parts))


def parsed(path: Path, regex: re.Pattern[str]) -> list[re.Match[str]]:
    """Every line of ``path``, each of which must match ``regex`` whole."""
    lines = path.read_text(encoding="utf-8").splitlines()
    unmatched = [line for line in lines if not regex.fullmatch(line)]
    assert not unmatched, (path.name, unmatched[:5])
    return [match for line in lines if (match := regex.fullmatch(line))]


def wait(predicate: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_background_servers_logs_read_as_torchserves(
        build_mar: Callable[..., Path], model_store: Path, tmp_path: Path) -> None:
    build_mar("talker", "talker")
    work = tmp_path / "work"
    work.mkdir()
    logs = work / "logs"
    (work / "config.properties").write_text(
        "inference_address=http://127.0.0.1:0\nmanagement_address=http://127.0.0.1:0\n"
        "metrics_address=http://127.0.0.1:0\ngrpc_inference_port=0\ngrpc_management_port=0\n"
        "default_workers_per_model=1\nenable_model_api=true\nmetrics_mode=log\n"
        f"log_location={logs}\n")
    env = {**os.environ, "BATCHSERVE_STATE_DIR": str(tmp_path / "state")}
    command = [str(BIN / "torchserve"), "--model-store", str(model_store),
               "--ts-config", "config.properties", "--disable-token-auth"]
    started = subprocess.run([*command, "--start", "--models", "talker=talker.mar"], cwd=work,
                             env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=120)
    assert started.returncode == 0, started.stdout + started.stderr
    assert f"logs:           {logs / 'ts_log.log'}" in started.stdout
    state = json.loads((tmp_path / "state" / "server.json").read_text())
    inference, management = state["inference"], state["management"]
    try:
        assert requests.post(f"{inference}/predictions/talker", data=b"hello",
                             timeout=60).content == b"hello"
        assert requests.get(f"{management}/models", timeout=30).status_code == 200
        registered = requests.post(f"{management}/models", timeout=120, params={
            "url": "talker.mar", "model_name": "second", "initial_workers": "0",
            "synchronous": "true"})
        assert registered.status_code == 200, registered.text
        assert requests.get(f"{inference}/ping?from=test", timeout=30).status_code == 200
        assert requests.get(f"{inference}/nope", timeout=30).status_code == 404
        assert requests.get(f"{state['metrics']}/metrics", timeout=30).status_code == 200
        with grpc.insecure_channel(f"127.0.0.1:{state['grpc_inference_port']}") as channel:
            stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
            stub.Predictions(inference_pb2.PredictionsRequest(
                model_name="talker", input={"body": b"over grpc"}), timeout=60)
            with pytest.raises(grpc.RpcError):
                stub.Predictions(inference_pb2.PredictionsRequest(model_name="none"),
                                 timeout=60)
        with grpc.insecure_channel(f"127.0.0.1:{state['grpc_management_port']}") as channel:
            management_pb2_grpc.ManagementAPIsServiceStub(channel).ListModels(
                management_pb2.ListModelsRequest(), timeout=60)
        model_log = logs / "model_log.log"
        wait(lambda: "said on stderr: over grpc" in model_log.read_text(), "the worker's lines")
    finally:
        stopped = subprocess.run([*command, "--stop"], cwd=work, env=env, capture_output=True,
                                 text=True, timeout=240)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr

    patterns = torchserve_patterns()
    assert sorted(path.name for path in logs.glob("*.log")) == sorted(patterns)

    # The access log: TorchServe's message, one line per request, every request (predictions,
    # management, ping, metrics, a 404; over gRPC by its method and its status code).
    access = [ACCESS_MESSAGE.fullmatch(match["message"])
              for match in parsed(logs / "access_log.log", line_regex(patterns["access_log.log"]))]
    assert all(access), access
    requests_seen = collections.Counter(
        (m["client"].startswith("/127.0.0.1:"), m["method"], m["uri"], m["protocol"],
         int(m["status"])) for m in access if m)
    expected = [
        ("POST", "/predictions/talker", "HTTP/1.1", 200),
        ("GET", "/models", "HTTP/1.1", 200),
        ("POST", "/models?url=talker.mar&model_name=second&initial_workers=0&synchronous=true",
         "HTTP/1.1", 200),
        ("GET", "/ping?from=test", "HTTP/1.1", 200),
        ("GET", "/nope", "HTTP/1.1", 404),
        ("GET", "/metrics", "HTTP/1.1", 200),
        ("gRPC", f"{INFERENCE}/Predictions", "HTTP/2.0", 0),  # OK
        ("gRPC", f"{INFERENCE}/Predictions", "HTTP/2.0", 5),  # NOT_FOUND
        ("gRPC", f"{MANAGEMENT}/ListModels", "HTTP/2.0", 0),
    ]
    for method, uri, protocol, status in expected:
        assert requests_seen[True, method, uri, protocol, status] == 1, (uri, requests_seen)

    # The model log: the worker's stdout at INFO, its stderr at WARN, under TorchServe's
    # reader threads' names; the line as the worker wrote it (no second timestamp).
    model = parsed(logs / "model_log.log", line_regex(patterns["model_log.log"]))
    assert {m["logger"] for m in model} == {"MODEL_LOG"}
    worker = r"W-\d+-talker_1\.0"
    said = {(m["level"], m["message"]) for m in model if re.fullmatch(worker + r"-std\w+",
                                                                        m["thread"])}
    for text in ("hello", "over grpc"):
        assert ("INFO ", f"said on stdout: {text}") in said, said
        assert ("WARN ", f"said on stderr: {text}") in said, said
        assert ("INFO ", f"logged: {text}") in said, said  # the worker's log is its stdout
    assert {(m["level"], m["thread"].rpartition("-")[2]) for m in model
            if m["message"].startswith("said on")} == {("INFO ", "stdout"), ("WARN ", "stderr")}
    assert not [m for m in model if re.match(r"\d{4}-\d\d-\d\d", m["message"])]

    # The server log: TorchServe's layout, every line (the server's output is its file).
    server = parsed(logs / "ts_log.log", line_regex(patterns["ts_log.log"]))
    assert any(m["logger"] == "batchserve" and m["message"].startswith("batchserve is serving")
               for m in server), [m.string for m in server][:20]
    assert any(m["logger"] == "MODEL_LOG" for m in server)  # additive, as TorchServe's

    # The metric logs (metrics_mode=log): TorchServe's metric lines.
    metrics = parsed(logs / "ts_metrics.log", line_regex(patterns["ts_metrics.log"]))
    assert metrics and all(METRIC_MESSAGE.fullmatch(m["message"]) for m in metrics), metrics
    assert any(m["message"].startswith("Requests2XX.Count:") for m in metrics)
    handler_metrics = parsed(logs / "model_metrics.log", line_regex(patterns["model_metrics.log"]))
    assert all(METRIC_MESSAGE.fullmatch(m["message"]) for m in handler_metrics), handler_metrics


def test_a_foreground_servers_console_and_server_log_read_as_torchserves(
        build_mar: Callable[..., Path], model_store: Path, tmp_path: Path) -> None:
    build_mar("talker", "talker")
    server = spawn_server(tmp_path, model_store, "talker=talker.mar")
    try:
        assert requests.post(f"{server.inference}/predictions/talker", data=b"hi",
                             timeout=60).status_code == 200
        model_log = tmp_path / "logs" / "model_log.log"
        wait(lambda: model_log.exists() and "said on stderr: hi" in model_log.read_text(),
             "the worker's lines")
    finally:
        assert server.stop() == 0
    pattern = line_regex(torchserve_patterns()["ts_log.log"])
    console = server.log_text().splitlines()
    # TorchServe's console: its layout, and "Model server started." as its launcher awaits.
    assert [line for line in console if not pattern.fullmatch(line)] == \
        ["Model server started."], console[:20]
    # The server log holds what the console shows, from the first line on.
    logged = (tmp_path / "logs" / "ts_log.log").read_text().splitlines()
    assert sorted(logged) == sorted(line for line in console if pattern.fullmatch(line))
