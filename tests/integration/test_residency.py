"""More models than fit (issue 36; docs/residency.md), against the real server: real worker
processes forked from the fork server, real archives, real HTTP clients.

Residency limits register the models beyond them paged out; a request pages its model in
(once, however many ask at once), paging out the least recently used idle model; a model with
requests queued or in a worker, or an open sequence, or pinned, is never paged out; a page-in
that fails answers its waiting requests with the load's error and touches no other model; the
count, host memory and GPU budgets hold at every moment (the fork server's live children are
counted while it runs); describe and the metrics page show it all. Without limits nothing of
it shows.
"""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import requests
import torch
import yaml

from frontend.config import Address
from tests.conftest import RunningServer

SEQUENCE = "ts_request_sequence_id"


def _state(server: RunningServer, model: str) -> str:
    return server.describe(model)["residency"]["state"]  # type: ignore[index,no-any-return]


def _residency(server: RunningServer, model: str) -> dict[str, object]:
    return server.describe(model)["residency"]  # type: ignore[return-value]


def _pids(server: RunningServer, model: str) -> list[int]:
    return [w["pid"] for w in server.describe(model)["workers"]]  # type: ignore[index,union-attr]


def _metric(server: RunningServer, family: str, model: str) -> float:
    text = requests.get(f"{server.metrics}/metrics", timeout=30).text
    match = re.search(rf'^{family}\{{model_name="{model}",model_version="1.0",?\}} (\S+)$', text,
                      re.MULTILINE)
    return float(match.group(1)) if match else 0.0


class WorkerCount:
    """Polls the fork server's live children (the workers) in a thread while the block runs;
    ``most`` is the largest count seen."""

    def __init__(self, server: RunningServer) -> None:
        assert server.server.services is not None
        forkserver = server.server.services.loader.forkserver
        assert forkserver is not None and forkserver.pid is not None
        self._process = psutil.Process(forkserver.pid)
        self.most = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def count(self) -> int:
        live = 0
        for child in self._process.children():
            try:
                live += child.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                pass
        return live

    def _poll(self) -> None:
        while not self._done.is_set():
            self.most = max(self.most, self.count())

    def __enter__(self) -> WorkerCount:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join()


@pytest.fixture
def echoes(build_mar: Callable[..., Path]) -> Callable[..., list[str]]:
    """Echo archives named ``names``, each with a weights file of ``weights`` bytes."""

    def build(*names: str, weights: int = 0, tmp: Path | None = None) -> list[str]:
        extra: tuple[str, ...] = ()
        if weights:
            assert tmp is not None
            blob = tmp / "weights.bin"
            blob.write_bytes(b"\0" * weights)
            extra = (str(blob),)
        for name in names:
            build_mar(name, "echo", extra_files=extra)
        return [f"{name}.mar" for name in names]

    return build


def test_least_recently_used_idle_model_is_paged_out_and_the_limit_holds(
        echoes: Callable[..., list[str]], start_server: Callable[..., RunningServer]) -> None:
    server = start_server(*echoes("a", "b", "c"), max_loaded_models=2)
    server.wait_for(lambda: _state(server, "a") == _state(server, "b") == "loaded",
                    "the first two models loaded")
    assert _state(server, "c") == "paged_out" and _pids(server, "c") == []
    with WorkerCount(server) as workers:
        # c pages in: a and b were never asked for; a became resident first.
        assert server.predict("c", b"to c").content == b"to c"
        assert (_state(server, "a"), _state(server, "b"), _state(server, "c")) == \
            ("paged_out", "loaded", "loaded")
        assert server.predict("b", b"to b").content == b"to b"
        # a pages in: c was used before b, so c goes.
        assert server.predict("a", b"to a").content == b"to a"
        assert (_state(server, "a"), _state(server, "b"), _state(server, "c")) == \
            ("loaded", "loaded", "paged_out")
    assert workers.most <= 2, f"{workers.most} workers ran at once with max_loaded_models=2"
    c = _residency(server, "c")
    assert c["pageIns"] == 1 and c["evictions"] == 1 and c["lastUsed"] is not None
    assert isinstance(c["lastPageInMs"], float) and c["lastPageInMs"] > 0
    assert _metric(server, "batchserve_model_page_ins_total", "c") == 1
    assert _metric(server, "batchserve_model_evictions_total", "a") == 1
    assert _metric(server, "batchserve_model_evictions_total", "b") == 0
    text = requests.get(f"{server.metrics}/metrics", timeout=30).text
    assert "batchserve_models_loaded 2" in text
    for step in ("evict", "fork", "load", "first_batch", "total"):
        assert f'model_name="c",model_version="1.0",step="{step}"' in text


def test_a_model_asked_again_and_again_outlives_one_asked_once_lately(
        echoes: Callable[..., list[str]], start_server: Callable[..., RunningServer]) -> None:
    """LRU-2: the victim is the idle model least recently used by its request before last; a
    model asked once (paged in for one request) goes before a hot one asked less lately."""
    server = start_server(*echoes("hot", "once", "new"), max_loaded_models=2)
    server.wait_for(lambda: _state(server, "hot") == _state(server, "once") == "loaded",
                    "the first two models loaded")
    for _ in range(3):
        assert server.predict("hot", b"h").status_code == 200
    assert server.predict("once", b"o").status_code == 200  # used last, but only once
    assert server.predict("new", b"n").content == b"n"
    assert (_state(server, "hot"), _state(server, "once"), _state(server, "new")) == \
        ("loaded", "paged_out", "loaded")


def test_concurrent_requests_for_a_paged_out_model_page_it_in_once(
        echoes: Callable[..., list[str]], start_server: Callable[..., RunningServer]) -> None:
    server = start_server(*echoes("a", "b"), max_loaded_models=1,
                          default_max_batch_delay_ms=0)
    server.wait_for(lambda: _state(server, "a") == "loaded", "a loaded")
    assert _state(server, "b") == "paged_out"
    with ThreadPoolExecutor(8) as pool, WorkerCount(server) as workers:
        answers = list(pool.map(lambda i: server.predict("b", f"b{i}".encode()), range(16)))
    assert [a.status_code for a in answers] == [200] * 16
    assert [a.content for a in answers] == [f"b{i}".encode() for i in range(16)]
    assert _residency(server, "b")["pageIns"] == 1
    assert _metric(server, "batchserve_model_page_ins_total", "b") == 1
    assert len(_pids(server, "b")) == 1 and _state(server, "a") == "paged_out"
    assert workers.most <= 1


def test_a_busy_model_is_not_paged_out_until_it_is_idle(
        build_mar: Callable[..., Path], echoes: Callable[..., list[str]],
        start_server: Callable[..., RunningServer], tmp_path: Path) -> None:
    build_mar("gate", "gate")
    server = start_server("gate.mar", *echoes("b"), max_loaded_models=1)
    server.wait_for(lambda: _state(server, "gate") == "loaded", "gate loaded")
    gate = tmp_path / "open"
    gate_pid = _pids(server, "gate")
    with ThreadPoolExecutor(4) as pool:
        held = server.hold_gate(pool, gate, queued=1)
        waiting = pool.submit(server.predict, "b", b"to b")
        server.wait_for(lambda: server.describe("b")["jobQueueStatus"]["pendingRequests"]  # type: ignore[index]
                        == 1, "b's request queued for its page-in")
        # One in the worker, one queued: gate stays, b waits (and a short deadline expires).
        short = server.predict("b", b"late", headers={"X-Request-Timeout": "0.5"})
        assert short.status_code == 504, short.text
        assert _state(server, "gate") == "loaded" and _pids(server, "gate") == gate_pid
        assert not waiting.done()
        gate.touch()
        assert [f.result(timeout=60).status_code for f in held] == [200, 200]
        answer = waiting.result(timeout=60)
    assert answer.status_code == 200 and answer.content == b"to b"
    assert _state(server, "gate") == "paged_out" and _state(server, "b") == "loaded"


def test_a_model_with_an_open_sequence_keeps_it(
        build_mar: Callable[..., Path], echoes: Callable[..., list[str]],
        start_server: Callable[..., RunningServer], tmp_path: Path) -> None:
    config = tmp_path / "stateful.yaml"
    config.write_text(yaml.safe_dump({
        "minWorkers": 1, "maxWorkers": 1, "sequenceBatching": True,
        "sequenceMaxIdleMSec": 60000, "maxNumSequence": 4, "maxSequenceJobQueueSize": 4}))
    build_mar("stateful", "stateful", config_file=config)
    server = start_server("stateful.mar", *echoes("b"), max_loaded_models=1)
    server.wait_for(lambda: _state(server, "stateful") == "loaded", "stateful loaded")
    first = server.predict("stateful", b"1", headers={SEQUENCE: "s1"})
    assert first.status_code == 200 and first.json() == 1
    # b cannot be paged in while the sequence is open: its request runs out of time.
    refused = server.predict("b", b"to b", headers={"X-Request-Timeout": "1"})
    assert refused.status_code == 504
    second = server.predict("stateful", b"2", headers={SEQUENCE: "s1"})
    assert second.status_code == 200 and second.json() == 3  # the state is still there
    assert _residency(server, "stateful")["evictions"] == 0
    # Closed (an input of 0 ends it), the stateful model is idle and may go.
    assert server.predict("stateful", b"0", headers={SEQUENCE: "s1"}).status_code == 200
    server.wait_for(lambda: server.describe("stateful")["batching"]["openSequences"] == 0,  # type: ignore[index]
                    "the sequence closed")
    assert server.predict("b", b"to b").content == b"to b"
    assert _state(server, "stateful") == "paged_out"


def test_a_failing_page_in_answers_its_waiters_and_leaves_the_others(
        build_mar: Callable[..., Path], echoes: Callable[..., list[str]],
        start_server: Callable[..., RunningServer]) -> None:
    build_mar("broken", "fails_load")
    server = start_server(*echoes("a", "b"), "broken.mar", max_loaded_models=2)
    server.wait_for(lambda: _state(server, "a") == _state(server, "b") == "loaded",
                    "a and b loaded")
    pids = {name: _pids(server, name) for name in ("a", "b")}
    assert _state(server, "broken") == "paged_out"
    server.predict("a", b"a")  # b is the least recently used: the failed page-in took it
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: server.predict("broken", b"x"), range(4)))
    for answer in answers:
        assert answer.status_code == 500, answer.text
        assert "failed to load on demand" in answer.json()["message"]
        assert "the weights file is corrupt" in answer.json()["message"]
    server.wait_for(lambda: _state(server, "broken") == "paged_out", "broken paged out again")
    assert _pids(server, "broken") == []
    assert _pids(server, "a") == pids["a"] and _residency(server, "a")["evictions"] == 0
    assert server.predict("a", b"still a").content == b"still a"
    assert server.predict("b", b"still b").content == b"still b"


def test_a_pinned_model_is_never_paged_out(
        echoes: Callable[..., list[str]], start_server: Callable[..., RunningServer]) -> None:
    server = start_server(*echoes("a", "b"), max_loaded_models=2)
    server.wait_for(lambda: _state(server, "a") == _state(server, "b") == "loaded",
                    "a and b loaded")
    echoes("pinned")
    answer = requests.post(f"{server.management}/models", timeout=60, params={
        "url": "pinned.mar", "pinned": "true", "synchronous": "true"})
    assert answer.status_code == 200, answer.text
    residency = _residency(server, "pinned")
    assert residency["pinned"] is True and residency["state"] == "loaded"
    pinned_pids = _pids(server, "pinned")
    for name in ("a", "b", "a", "b"):
        assert server.predict(name, name.encode()).content == name.encode()
        assert _state(server, "pinned") == "loaded"
    assert _pids(server, "pinned") == pinned_pids
    assert _residency(server, "pinned")["evictions"] == 0
    # Two pinned models fill the limit: a third pinned one could never be loaded.
    echoes("pinned2", "pinned3")
    ok = requests.post(f"{server.management}/models", timeout=60,
                       params={"url": "pinned2.mar", "pinned": "true", "synchronous": "true"})
    assert ok.status_code == 200, ok.text
    refused = requests.post(f"{server.management}/models", timeout=60,
                            params={"url": "pinned3.mar", "pinned": "true"})
    assert refused.status_code == 507, refused.text
    assert "max_loaded_models=2" in refused.json()["message"]
    assert requests.get(f"{server.management}/models/pinned3", timeout=30).status_code == 404
    # No room can ever be made for a: answered at once, saying why.
    answer = server.predict("a", b"a")
    assert answer.status_code == 503 and "pinned" in answer.json()["message"]


@pytest.mark.parametrize("budget", ["max_loaded_memory_bytes", "gpu_memory_budget_bytes"])
def test_memory_budgets_hold(budget: str, echoes: Callable[..., list[str]],
                             start_server: Callable[..., RunningServer], tmp_path: Path) -> None:
    """The host budget, and the GPU budget on a host that says it has one GPU (placement
    without a GPU: the workers run on the CPU, the accounting is the GPU's)."""
    size = 1 << 20
    names = echoes("a", "b", "c", weights=size, tmp=tmp_path)
    server = start_server(*names, **{budget: int(2.5 * size)},
                          visible_gpus=1 if budget.startswith("gpu") else 0)
    server.wait_for(lambda: _state(server, "a") == _state(server, "b") == "loaded",
                    "a and b loaded")
    assert _state(server, "c") == "paged_out"
    assert int(_residency(server, "a")["memoryBytes"]) > size  # type: ignore[call-overload]
    with WorkerCount(server) as workers:
        for name in ("c", "a", "b", "c"):
            assert server.predict(name, name.encode()).content == name.encode()
    assert workers.most <= 2


def test_without_limits_nothing_pages(echoes: Callable[..., list[str]],
                                      start_server: Callable[..., RunningServer]) -> None:
    server = start_server(*echoes("a"))
    assert "residency" not in server.describe("a")
    text = requests.get(f"{server.metrics}/metrics", timeout=30).text
    assert "batchserve_models_loaded" not in text and "page_in" not in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_page_in_on_a_gpu(echoes: Callable[..., list[str]],
                          start_server: Callable[..., RunningServer], tmp_path: Path) -> None:
    """On a real GPU: the budget counts each worker's copy; paging in puts the worker on it."""
    size = 1 << 20
    names = echoes("a", "b", weights=size, tmp=tmp_path)
    server = start_server(*names, gpu_memory_budget_bytes=int(1.5 * size), number_of_gpu=1)
    server.wait_for(lambda: _state(server, "a") == "loaded", "a loaded")
    assert server.predict("b", b"b").content == b"b"
    assert server.describe("b")["workers"][0]["gpu"] is True  # type: ignore[index]
    assert (_state(server, "a"), _state(server, "b")) == ("paged_out", "loaded")



def _sagemaker_calls(server: RunningServer) -> list[tuple[int, object]]:
    """A SageMaker multi-model agent's calls on one listener (inference and management share
    it, as the toolkit starts the server): load three models, invoke each in turn twice, list,
    unload one, invoke the others; each answer's status and body (a load's: its status)."""
    url = server.inference
    seen: list[tuple[int, object]] = []
    for name in ("m1", "m2", "m3"):
        loaded = requests.post(f"{url}/models", timeout=60,
                               json={"model_name": name, "url": f"{name}.mar"})
        seen.append((loaded.status_code, None))
    for name in ("m1", "m2", "m3", "m1", "m3", "m2"):
        invoked = requests.post(f"{url}/models/{name}/invoke", data=name.encode(), timeout=60)
        seen.append((invoked.status_code, invoked.content))
    listed = requests.get(f"{url}/models", timeout=30)
    seen.append((listed.status_code, listed.json()))
    unloaded = requests.delete(f"{url}/models/m1", timeout=60)
    seen.append((unloaded.status_code, unloaded.json()))
    for name in ("m2", "m3", "m1"):
        invoked = requests.post(f"{url}/models/{name}/invoke", data=name.encode(), timeout=60)
        seen.append((invoked.status_code, invoked.content))
    return seen


def test_sagemaker_multi_model_calls_answer_as_without_limits(
        echoes: Callable[..., list[str]], start_server: Callable[..., RunningServer]) -> None:
    echoes("m1", "m2", "m3")
    answers = []
    for limits in ({}, {"max_loaded_models": 1}):
        port = _free_port()
        address = Address("127.0.0.1", port)
        server = start_server(inference_address=address, management_address=address,
                              snapshot_disabled=True, **limits)
        answers.append(_sagemaker_calls(server))
    assert answers[0] == answers[1]
    assert answers[1][-1][0] == 404  # unloaded
    assert _residency(server, "m3")["pageIns"] == 3  # invoked three times, one slot


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
