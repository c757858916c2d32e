"""The residency benchmark's pieces (benchmarks/residency.py, benchmarks/residency_watch.py),
in process: its Zipf traffic, its models' weights and checksums (as the handler computes
them), which model a process serves (the weights file it holds open), and the server's
page-in account read from a metrics page in DESIGN36.md's names."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from benchmarks.handlers import weights_reader
from benchmarks.residency import Plan, make_models, weights_file, zipf_traffic
from benchmarks.residency_watch import ResidencyWatch, bucket_quantile, page_in_metrics


def test_the_traffic_is_zipf_over_the_ranks_seeded_and_different_per_client() -> None:
    plan = Plan(models=6, clients=4)
    traffic = zipf_traffic(plan, seed=3, count=3000)
    assert traffic == zipf_traffic(plan, seed=3, count=3000)
    assert traffic != zipf_traffic(plan, seed=4, count=3000)
    assert len(traffic) == 4 and len({tuple(mine) for mine in traffic}) == 4
    counts = Counter(model for mine in traffic for model in mine)
    # 1/k over 6 ranks: shares 0.408, 0.204, 0.136, 0.102, 0.082, 0.068 (12,000 draws).
    harmonic = sum(1 / k for k in range(1, 7))
    for rank, name in enumerate(plan.names, start=1):
        assert abs(counts[name] / 12000 - 1 / rank / harmonic) < 0.02, (name, counts)


def test_each_model_has_its_own_weights_and_the_handler_answers_with_their_checksum(
        tmp_path: Path) -> None:
    plan = Plan(models=3, weights_mb=0.08, max_loaded=1)
    store = tmp_path / "store"
    store.mkdir()
    checksums = make_models(store, plan, tmp_path)
    assert len(set(checksums.values())) == 3
    for name in plan.names:
        folder = store / name
        manifest = json.loads((folder / "MAR-INF" / "MANIFEST.json").read_text())
        assert manifest["model"]["serializedFile"] == weights_file(name)
        weights = np.fromfile(folder / weights_file(name), dtype=np.uint64)
        assert weights.nbytes == 80_000
        assert checksums[name] == f"{int(weights.sum(dtype=np.uint64)):016x}"
    again = tmp_path / "again"
    again.mkdir()
    assert make_models(again, plan, tmp_path) == checksums  # seeded: the same every time
    # The handler, loaded as a server loads it, answers with m01's name and checksum.
    context = SimpleNamespace(manifest=json.loads(
        (store / "m01" / "MAR-INF" / "MANIFEST.json").read_text()),
        system_properties={"model_dir": str(store / "m01")})
    weights_reader._loaded.clear()
    try:
        assert weights_reader.handle(None, context) is None
        answers = weights_reader.handle([{"body": b"0:1"}, {"data": "0:2"}], context)
        assert [json.loads(a) for a in answers or []] == [
            {"model": "m01", "checksum": checksums["m01"], "echo": echo}
            for echo in ("0:1", "0:2")]
    finally:
        weights_reader._loaded["file"].close()
        weights_reader._loaded.clear()


HOLDER = """import sys
held = open(sys.argv[1], "rb")
print("held", flush=True)
sys.stdin.read()
"""


def test_a_process_counts_for_the_model_whose_weights_it_holds_open(tmp_path: Path) -> None:
    weights = tmp_path / weights_file("m02")
    weights.write_bytes(b"w" * 64)
    # A parent (standing for the server) with one child holding m02's weights open.
    with subprocess.Popen([sys.executable, "-c",
                           "import subprocess, sys; child = subprocess.Popen([sys.executable,"
                           " '-c', sys.argv[1], sys.argv[2]]); child.wait()",
                           HOLDER, str(weights)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE) as parent:
        assert parent.stdout is not None and parent.stdout.readline() == b"held\n"
        watch = ResidencyWatch(parent.pid, {weights_file("m02"): "m02",
                                            weights_file("m03"): "m03"})
        sample = watch.sample()
        assert sample.models == frozenset({"m02"}) and sample.processes == 1
        watch.samples.append(sample)
        assert watch.most_models == 1 and watch.over(0) == 1 and watch.over(1) == 0
        assert parent.stdin is not None
        parent.stdin.close()  # the child reads to its end and exits, then the parent
        parent.wait(timeout=30)
    # Gone: nothing held.
    assert ResidencyWatch(parent.pid, {weights_file("m02"): "m02"}).sample().models == set()


METRICS = """\
# HELP batchserve_model_page_ins_total Times a model was loaded on demand (paged in)
# TYPE batchserve_model_page_ins_total counter
batchserve_model_page_ins_total{model_name="a"} 3.0
batchserve_model_page_ins_total{model_name="b"} 2.0
# HELP batchserve_model_evictions_total Times a model was paged out to make room for another
# TYPE batchserve_model_evictions_total counter
batchserve_model_evictions_total{model_name="a"} 4.0
# HELP batchserve_model_page_in_seconds Time of each step of a model's page-in
# TYPE batchserve_model_page_in_seconds histogram
batchserve_model_page_in_seconds_bucket{model_name="a",step="fork",le="0.01"} 1.0
batchserve_model_page_in_seconds_bucket{model_name="a",step="fork",le="0.1"} 3.0
batchserve_model_page_in_seconds_bucket{model_name="a",step="fork",le="+Inf"} 3.0
batchserve_model_page_in_seconds_sum{model_name="a",step="fork"} 0.12
batchserve_model_page_in_seconds_count{model_name="a",step="fork"} 3.0
batchserve_model_page_in_seconds_bucket{model_name="b",step="fork",le="0.01"} 0.0
batchserve_model_page_in_seconds_bucket{model_name="b",step="fork",le="0.1"} 2.0
batchserve_model_page_in_seconds_bucket{model_name="b",step="fork",le="+Inf"} 2.0
batchserve_model_page_in_seconds_sum{model_name="b",step="fork"} 0.08
batchserve_model_page_in_seconds_count{model_name="b",step="fork"} 2.0
batchserve_model_page_in_seconds_bucket{model_name="a",step="total",le="0.01"} 0.0
batchserve_model_page_in_seconds_bucket{model_name="a",step="total",le="0.1"} 0.0
batchserve_model_page_in_seconds_bucket{model_name="a",step="total",le="+Inf"} 3.0
batchserve_model_page_in_seconds_sum{model_name="a",step="total"} 0.9
batchserve_model_page_in_seconds_count{model_name="a",step="total"} 3.0
# HELP batchserve_models_loaded Model versions loaded now (their workers run)
# TYPE batchserve_models_loaded gauge
batchserve_models_loaded 2.0
"""


def test_the_page_in_account_is_read_by_step_summed_over_models() -> None:
    account = page_in_metrics(METRICS)
    assert account.present and account.page_ins == 5 and account.evictions == 4
    assert account.models_loaded == 2
    assert set(account.steps) == {"fork", "total"}
    fork = account.steps["fork"]
    assert fork.count == 5 and math.isclose(fork.mean_ms, 40.0)
    assert fork.buckets == {0.01: 1.0, 0.1: 5.0, math.inf: 5.0}
    # The median (rank 2.5 of 5) lies in (0.01, 0.1]: 1.5 of its 4 -> 0.01 + 0.09 * 0.375.
    assert math.isclose(fork.quantile_ms(0.5), (0.01 + 0.09 * 0.375) * 1000)
    # Past the last finite bound: its lower edge (as Prometheus answers).
    assert math.isclose(account.steps["total"].quantile_ms(0.99), 100.0)
    # A server without residency exports none of them.
    plain = page_in_metrics("# TYPE ts_inference_requests_total counter\n"
                            "ts_inference_requests_total 3.0\n")
    assert not plain.present and plain.page_ins == 0 and not plain.steps


def test_bucket_quantiles_interpolate_within_their_bucket() -> None:
    buckets = [(0.1, 0.0), (0.2, 10.0), (math.inf, 10.0)]
    assert math.isclose(bucket_quantile(buckets, 0.5), 0.15)
    assert math.isclose(bucket_quantile(buckets, 1.0), 0.2)
    assert math.isnan(bucket_quantile([], 0.5))
    assert math.isnan(bucket_quantile([(0.1, 0.0), (math.inf, 0.0)], 0.5))
