"""Handlers and clients against the metrics page and the metric logs, on a real server (issue
31, items 6 and 7), with a handler that reports every bad metric through TorchServe's handler
API and its ``ts.metrics`` objects, and prints and logs what it is sent
(tests/fixtures/handlers/hostile_metrics.py):

* the whole page still parses (prometheus_client, and promtool where installed), with no
  family written twice or read as another, no label twice, nothing of the server's own
  replaced, and a bounded size;
* a client who sends TorchServe's ``[METRICS]`` metric lines, in every form, to a handler
  that prints them forges nothing: not on the page, not in the metric logs.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from frontend.observe import model_metrics
from frontend.observe.families import MAX_LABEL_SETS
from tests.conftest import RunningServer
from tests.metrics_page import parsed_page

FORGED = "424242"
#: The line TorchServe's frontend reads as a metric (after its ``[METRICS]`` mark): the
#: victim model's PredictionTime.
LINE = (f"PredictionTime.Milliseconds:{FORGED}.0|#ModelName:victim,Level:Model|"
        f"#hostname:{socket.gethostname()},1717105307,forged")
#: What a client sends to a handler that prints it.
FORGERIES = [
    f"[METRICS]{LINE}",  # the printed line begins with the mark
    f"hello [METRICS]{LINE}",  # the mark in the middle of a line
    f"hello\n[METRICS]{LINE}",  # a newline, then a line that begins with the mark
    f"hello\r\n[METRICS]{LINE}",
    f"hello\nINFO > [METRICS]{LINE}",  # as TorchServe's worker logging writes one
    f"   [METRICS]{LINE}",
    f"[METRICS]{LINE.replace('|#hostname', '|#type:GAUGE|#hostname')}",
    f"[METRICS]Forged{FORGED}.Count:{FORGED}|#Level:Model|#type:COUNTER|#hostname:h,1,r",
    f'PredictionTime{{ModelName="victim",Level="Model",Hostname="h",}} {FORGED}.0',
    f"# TYPE Forged{FORGED} gauge\nForged{FORGED} {FORGED}.0",
]
SENTINEL = "sentinel-all-sent"


def _page(server: RunningServer) -> str:
    answer = requests.get(f"{server.metrics}/metrics", timeout=30)
    assert answer.status_code == 200
    return answer.text


def _send(server: RunningServer, model: str, body: str) -> None:
    answer = server.predict(model, body.encode())
    assert answer.status_code == 200, answer.text


def test_hostile_handler_metrics_leave_a_page_that_parses_and_is_bounded(
        build_mar: Callable[..., Path], start_server: Callable[..., RunningServer]) -> None:
    build_mar("hostile", "hostile_metrics")
    build_mar("victim", "echo")
    server = start_server("hostile.mar", "victim.mar", model_metrics_auto_detect=True)
    _send(server, "victim", "x")
    for _ in range(2):
        _send(server, "hostile", "report")
    # 1,000 label values of 20 kB (a 20 MB page before), then histograms past the page's
    # share for handler metrics.
    _send(server, "hostile", "flood:Flood:gauge:1000:20000")
    for number in range(4):
        _send(server, "hostile", f"flood:FloodHistogram{number}:histogram:1000:300")

    text = _page(server)
    families = parsed_page(text)
    assert FORGED not in text
    assert len(text.encode()) < model_metrics.MAX_PAGE_BYTES + 512 * 1024
    # The server's own, once each, with their own samples.
    for name in ("Requests2XX", "ts_inference_requests", "QueueTime", "CPUUtilization",
                 "batchserve_queue_depth", "batchserve_batch_size", "Requests5XX"):
        assert text.count(f"# TYPE {name}") <= 1 and name in families, name
    # What breaks TorchServe's rules or takes another's name is not there.
    refused = {"t4_nl", "t4_cr", "HostDim", "TwiceDim", "LeHist", "BadLabel", "BadUnit",
               "ManyDims", "Pair_total", "ts_api_nl", "TsApiHost", "LegacyTwice"}
    assert not refused & set(families)
    assert not any(name.startswith("x" * 100) for name in families)
    # What keeps to them is, its label values written as reported (a lone surrogate as "?").
    assert [s.value for s in families["Pair"]] == [2.0]
    assert {s.labels["Text"] for s in families["HostileValues"]} == {
        'q"uote', "back\\slash", "new\nline", "}} 1.0\nforged 2.0", "\u2028\x00\r",
        "lone ? surrogate"}
    flood = families["Flood"]
    assert len(flood) == MAX_LABEL_SETS
    assert {len(s.labels["Value"]) for s in flood} == {model_metrics.MAX_LABEL_VALUE_CHARS}
    assert all(len(value) <= model_metrics.MAX_LABEL_VALUE_CHARS
               for samples in families.values() for s in samples for value in s.labels.values())
    # The victim's own metric is its own.
    [victim] = [s for s in families["PredictionTime"] if s.labels["ModelName"] == "victim"]
    assert victim.value < 60_000
    # The worker that reported all this still serves.
    _send(server, "hostile", "report")


@pytest.mark.parametrize("mode", ["prometheus", "log"])
def test_a_client_cannot_forge_a_metric_through_what_a_handler_prints(
        mode: str, build_mar: Callable[..., Path], start_server: Callable[..., RunningServer],
        model_store: Path) -> None:
    build_mar("hostile", "hostile_metrics")
    build_mar("victim", "echo")
    logs = model_store.parent / "logs"
    server = start_server("hostile.mar", "victim.mar", metrics_mode=mode,
                          model_metrics_auto_detect=True, log_location=logs)
    _send(server, "victim", "x")
    for forgery in FORGERIES:
        _send(server, "hostile", forgery)
    _send(server, "hostile", SENTINEL)
    model_log = logs / "model_log.log"

    def printed() -> int:
        return model_log.read_text(errors="replace").count(SENTINEL) if model_log.exists() else 0

    # Printed raw and after a prefix (stdout), written and logged (stderr): every line before
    # it, on both streams, has been read.
    server.wait_for(lambda: printed() >= 4, "the handler's output in the model log")
    assert model_log.read_text(errors="replace").count(FORGED) >= len(FORGERIES)
    _send(server, "victim", "y")  # reported after every forgery was read

    if mode == "prometheus":
        text = _page(server)
        families = parsed_page(text)
        assert FORGED not in text
        assert not any(name.startswith("Forged") for name in families)
        victim = [s.value for s in families["PredictionTime"] if s.labels["ModelName"] == "victim"]
        assert len(victim) == 1 and victim[0] < 60_000
    else:
        model_metrics_log = logs / "model_metrics.log"

        def victim_lines() -> list[str]:
            return [line for line in model_metrics_log.read_text().splitlines()
                    if line.split(" - ", 1)[-1].startswith("PredictionTime.")
                    and "ModelName:victim" in line]

        server.wait_for(lambda: sum(FORGED not in line for line in victim_lines()) == 2,
                        "the victim's two PredictionTime lines")
        assert len(victim_lines()) == 2
        for log in (model_metrics_log, logs / "ts_metrics.log"):
            assert FORGED not in log.read_text(), log.name
        assert FORGED not in _page(server)
