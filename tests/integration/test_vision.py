"""The image_classifier handler through the real server, with a tiny model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from tests.integration.vision_fixtures import LABELS, build_tiny_classifier, jpeg

LABEL_NAMES = {label for _, label in LABELS.values()}


def test_classifier_answers_raw_multipart_and_base64_json(model_store: Path,
                                                          start_server) -> None:
    import base64
    import json

    build_tiny_classifier(model_store)
    server = start_server("tiny.mar")
    image = jpeg(1)

    raw = server.predict("tiny", image)
    assert raw.status_code == 200, raw.text
    scores = raw.json()
    assert set(scores) == LABEL_NAMES
    assert abs(sum(scores.values()) - 1.0) < 1e-4

    form = requests.post(f"{server.inference}/predictions/tiny",
                         files={"data": ("x.jpg", image, "image/jpeg")}, timeout=60)
    assert form.json() == scores

    as_json = server.predict("tiny", json.dumps({"data": base64.b64encode(image).decode()})
                             .encode(), headers={"content-type": "application/json"})
    assert as_json.json() == scores


def test_one_corrupt_image_in_a_batch_fails_alone(model_store: Path, start_server) -> None:
    build_tiny_classifier(model_store)
    server = start_server()
    requests.post(f"{server.management}/models",
                  params={"url": "tiny.mar", "batch_size": 8, "max_batch_delay": 5000,
                          "batch_policy": "fixed",
                          "initial_workers": 1, "synchronous": "true"},
                  timeout=120).raise_for_status()
    bodies = [jpeg(i) for i in range(7)] + [b"\xff\xd8\xff\xe0 truncated jpeg"]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda body: server.predict("tiny", body), bodies))

    assert [a.status_code for a in answers] == [200] * 7 + [400]
    assert all(set(a.json()) == LABEL_NAMES for a in answers[:7])
    error = answers[7].json()
    assert error["code"] == 400 and "image" in error["message"].lower()
    assert server.describe("tiny")["batching"]["recentBatchSizes"] == [8]  # type: ignore[index]


def test_bad_inputs_are_4xx_and_the_worker_stays_up(model_store: Path, start_server) -> None:
    build_tiny_classifier(model_store)
    server = start_server("tiny.mar")
    pid = server.describe("tiny")["workers"][0]["pid"]  # type: ignore[index]
    for body in (b"", b"just some text, not a picture", b"\x89PNG\r\n\x1a\n broken"):
        answer = server.predict("tiny", body)
        assert 400 <= answer.status_code < 500, (body, answer.text)
        assert answer.json()["message"]
    assert server.predict("tiny", jpeg(3)).status_code == 200
    assert server.describe("tiny")["workers"][0]["pid"] == pid  # type: ignore[index]
