"""A SageMaker multi-model endpoint under memory pressure (issue 36): batchserve started by the
real SageMaker inference toolkit's ``serve`` (``SAGEMAKER_MULTI_MODEL=true``, as in
tests/integration/test_sagemaker.py), with at most two models loaded (``TS_MAX_LOADED_MODELS``,
which the toolkit's config lets through: ``enable_envvars_config=true``), driven as SageMaker's
agent drives a multi-model container (its documented contract: load = ``POST /models`` with a
JSON body of ``model_name`` and ``url`` only, list = ``GET /models``, get = ``GET
/models/{name}``, invoke = ``POST /models/{name}/invoke`` with ``X-Amzn-SageMaker-Target-Model``,
unload = ``DELETE /models/{name}``).

On SageMaker's TorchServe containers the agent itself unloads models when a load answers 507
(no room). Here no load needs to: each answers 200 and the server pages models beneath the
agent's calls, which keep their answers: every load 200 (409 for one already loaded), every
model listed, every invocation answered by its own model, never more than two models' workers
up, a paged-out model asked by several at once paged in once, unloads of paged-out and loaded
models 200 and gone (404 after), the others answering on.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import requests
import torch

from tests.integration.residency_feature import needs_residency
from tests.integration.test_sagemaker import Container, expected, model_dir, npy, start_serve

LIMIT = 2
NAMES = ("alpha", "beta", "gamma")


def describe(container: Container, name: str) -> dict[str, Any]:
    answer = requests.get(f"{container.url}/models/{name}", timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()[0]  # type: ignore[no-any-return]


def states(container: Container) -> dict[str, str]:
    return {name: describe(container, name)["residency"]["state"] for name in NAMES}


def invoke(container: Container, name: str, rows: np.ndarray) -> requests.Response:
    return requests.post(f"{container.url}/models/{name}/invoke", data=npy(rows), timeout=120,
                         headers={"Content-Type": "application/x-npy",
                                  "Accept": "application/json",
                                  "X-Amzn-SageMaker-Target-Model": f"{name}.tar.gz"})


class WorkerWatch:
    """Polls describe in a thread: how many models have a worker whose process is alive (the
    server's word on its pids, checked against the operating system), at most."""

    def __init__(self, container: Container, names: tuple[str, ...]) -> None:
        self.container, self.names = container, names
        self.most, self.samples = 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            up = 0
            for name in self.names:
                try:
                    workers = describe(self.container, name)["workers"]
                except (requests.RequestException, AssertionError):
                    continue  # unloaded meanwhile
                up += any(worker.get("pid") and psutil.pid_exists(worker["pid"])
                          for worker in workers)
            self.most, self.samples = max(self.most, up), self.samples + 1
            self._stop.wait(0.05)

    def __enter__(self) -> WorkerWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


@needs_residency
def test_the_agents_calls_keep_their_answers_while_models_page_beneath_them(
        tmp_path: Path) -> None:
    root = tmp_path / "ml" / "models"
    linear: dict[str, torch.nn.Linear] = {
        name: model_dir(root / name / "model", seed=20 + index, batched=False)
        for index, name in enumerate(NAMES)}
    container = start_serve(tmp_path / "work", tmp_path / "ml", SAGEMAKER_MULTI_MODEL="true",
                            TS_MAX_LOADED_MODELS=str(LIMIT))
    try:
        url = container.url
        # Load, as the agent does: more models than may be loaded, each answered 200 (never
        # 507: the server makes room itself); one already loaded is 409, as the contract asks.
        for name in NAMES:
            loaded = requests.post(f"{url}/models", timeout=120, json={
                "model_name": name, "url": str(root / name / "model")})
            assert loaded.status_code == 200, loaded.text
        again = requests.post(f"{url}/models", timeout=120, json={
            "model_name": NAMES[0], "url": str(root / NAMES[0] / "model")})
        assert again.status_code == 409, again.text
        listed = requests.get(f"{url}/models", timeout=30).json()["models"]
        assert {model["modelName"] for model in listed} == set(NAMES)
        now = states(container)
        assert sum(state == "loaded" for state in now.values()) <= LIMIT, now
        assert "paged_out" in now.values(), now

        # Invocations of every model at once, in a shuffled order: each answered by its own
        # model (its own weights), never more than LIMIT models' workers up meanwhile.
        asks = [(name, float(turn)) for turn in range(2) for name in NAMES]
        random.Random(36).shuffle(asks)

        def ask(job: tuple[str, float]) -> tuple[str, np.ndarray, requests.Response]:
            name, value = job
            rows = np.full((1, 4), value, dtype=np.float32)
            return name, rows, invoke(container, name, rows)

        with WorkerWatch(container, NAMES) as watch, ThreadPoolExecutor(len(NAMES)) as pool:
            for name, rows, answer in pool.map(ask, asks):
                assert answer.status_code == 200, (name, answer.text)
                assert np.allclose(answer.json()["y"], expected(linear[name], rows),
                                   atol=1e-5), name
        assert watch.samples > 0 and watch.most <= LIMIT, watch.most

        # A paged-out model asked by several at once: paged in once, every answer its own.
        cold = next(name for name, state in states(container).items() if state == "paged_out")
        before = describe(container, cold)["residency"]["pageIns"]
        with ThreadPoolExecutor(4) as pool:
            for _, rows, answer in pool.map(ask, [(cold, float(i)) for i in range(4)]):
                assert answer.status_code == 200, answer.text
                assert np.allclose(answer.json()["y"], expected(linear[cold], rows), atol=1e-5)
        assert describe(container, cold)["residency"]["pageIns"] == before + 1

        # Unload, as the agent does: a paged-out model and a loaded one, each 200 and gone.
        now = states(container)
        paged_out = next(name for name, state in now.items() if state == "paged_out")
        loaded_one = next(name for name, state in now.items() if state == "loaded")
        for name in (paged_out, loaded_one):
            assert requests.delete(f"{url}/models/{name}", timeout=120).status_code == 200
            assert requests.get(f"{url}/models/{name}", timeout=30).status_code == 404
            assert invoke(container, name, np.zeros((1, 4), np.float32)).status_code == 404
        (left,) = set(NAMES) - {paged_out, loaded_one}
        listed = requests.get(f"{url}/models", timeout=30).json()["models"]
        assert [model["modelName"] for model in listed] == [left]
        rows = np.ones((1, 4), dtype=np.float32)
        answer = invoke(container, left, rows)
        assert answer.status_code == 200, answer.text
        assert np.allclose(answer.json()["y"], expected(linear[left], rows), atol=1e-5)
        assert describe(container, left)["residency"]["state"] == "loaded"
    finally:
        code = container.stop()
    assert code == 0, container.output()

