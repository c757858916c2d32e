"""The residency benchmark (benchmarks/residency.py) run whole in its smoke mode against real
servers (6 models of 1 MB, at most 3 loaded, 8 clients of 8 requests each, TorchServe
skipped), so that it cannot rot: every request is answered 200 by the model it named, the
sampler sees the models' workers, the on-demand registration is timed, and every server it
started is gone afterwards. With residency in the server (issue 36's core), the paged run also
never has more than 3 models' workers running, and counts its page-ins."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import gone
from tests.integration.residency_feature import needs_residency

ROOT = Path(__file__).resolve().parents[2]
MODELS, LIMIT, CLIENTS, REQUESTS = 6, 3, 8, 8


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("residency") / "residency.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.residency", "--smoke",
                           "--no-torchserve", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def test_the_smoke_run_answers_every_request_from_the_model_it_named(
        smoke: tuple[dict[str, Any], str]) -> None:
    result, stdout = smoke
    assert result["plan"]["models"] == MODELS and result["plan"]["max_loaded"] == LIMIT
    paged, resident = result["runs"]
    assert (paged["limit"], resident["limit"]) == (LIMIT, None)
    for run in (paged, resident):
        # Every request counted, none wrong: 200, its model's name and weights, its own body.
        assert run["requests"] >= CLIENTS * REQUESTS, run
        assert run["wrong"] == 0, run["problems"]
        assert sum(model["requests"] for model in run["per_model"].values()) == run["requests"]
        # Zipf: the hottest model got the most requests.
        counts = [run["per_model"][f"m{i:02d}"]["requests"] for i in range(MODELS)]
        assert counts[0] == max(counts), counts
        assert 0 < run["p50_ms"] <= run["p99_ms"], run
        # The sampler saw workers holding their models' weights, none of another model.
        assert run["samples"] >= 1 and 1 <= run["most_models"] <= MODELS, run
        assert gone(run["pid"]), run["pid"]
    # The resident server has every model's worker up, as the sampler sees it.
    assert resident["most_models"] == MODELS
    (registered,) = resident["on_demand"]  # the coldest model, registered on demand
    assert registered["model"] == f"m{MODELS - 1:02d}" and registered["ok"] is True
    assert 0 < registered["register_s"] <= registered["first_answer_s"], registered
    assert result["torchserve_on_demand"] == []
    assert "| max_loaded_models=3 | 64 | 0 |" in stdout
    assert "| all 6 resident | 64 | 0 |" in stdout
    assert "every request answered 200 by the model it named: yes" in stdout


@needs_residency
def test_the_smoke_run_pages_under_the_limit_and_counts_its_page_ins(
        smoke: tuple[dict[str, Any], str]) -> None:
    result, stdout = smoke
    assert result["residency_in_effect"], "describe shows no residency"
    paged, resident = result["runs"]
    # Never more than 3 models' workers running, in any sample; the traffic needed the others.
    assert paged["samples_over"] == 0 and paged["most_models"] <= LIMIT, paged["timeline"]
    assert paged["metrics"]["present"] and paged["metrics"]["page_ins"] >= 1, paged["metrics"]
    assert paged["metrics"]["evictions"] >= 1, paged["metrics"]
    states = {model: residency["state"] for model, residency in paged["residency"].items()}
    assert set(states) == {f"m{i:02d}" for i in range(MODELS)}
    assert sum(state == "loaded" for state in states.values()) <= LIMIT, states
    assert "paged_out" in states.values(), states
    # The quiet probe paged one model in and timed its first answer.
    assert len(paged["probes_ms"]) == 1 and paged["probes_ms"][0] > 0
    assert "PROVISIONAL" not in stdout
    assert f"never more than {LIMIT} models' workers running: yes" in stdout
    # Without a limit nothing is paged.
    assert resident["metrics"]["page_ins"] == 0 and resident["metrics"]["evictions"] == 0
