"""The scaling simulation behind docs/kubernetes.md (benchmarks/k8s_scaling.py): its default
scenario, run as the doc's table was, still shows what the doc says of each rule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.k8s_scaling import Outcome, Scenario, capped_pod, simulate

SCENARIO = Scenario()
RULES = ("none", "queue-depth", "queue-depth+rps", "ts-counter")
#: A full batch's service time: the unit the doc's "bounded p99" is counted in.
FULL_BATCH_S = SCENARIO.overhead_s + SCENARIO.per_item_s * SCENARIO.batch_size


@pytest.fixture(scope="module")
def runs() -> dict[str, Outcome]:
    return {rule: simulate(SCENARIO, rule, seed=1) for rule in RULES}


def test_without_scaling_the_peak_overflows_the_queues(runs: dict[str, Outcome]) -> None:
    none = runs["none"]
    assert none.max_replicas == none.final_replicas == SCENARIO.min_replicas
    assert none.refused_share() > 0.1
    assert none.latency_quantile(0.99, *SCENARIO.peak_window) > 10 * FULL_BATCH_S


def test_queue_depth_and_rps_follow_the_ramp_with_a_bounded_p99(
        runs: dict[str, Outcome]) -> None:
    both, none = runs["queue-depth+rps"], runs["none"]
    # Up with the rise: a minute into the peak (30 req/s, 10 a pod in full batches) ...
    assert both.replicas_at(SCENARIO.peak_window[0] + 60) >= 4
    assert both.final_replicas == SCENARIO.min_replicas  # and down after the fall
    assert both.reversals() == 0  # never took away a pod the load still needed
    assert both.refused_share() < 0.001
    assert both.latency_quantile(0.99) < 3 * FULL_BATCH_S
    assert both.latency_quantile(0.99) < none.latency_quantile(0.99) / 4


def test_queue_depth_alone_scales_down_too_far_and_back(runs: dict[str, Outcome]) -> None:
    depth, both, none = runs["queue-depth"], runs["queue-depth+rps"], runs["none"]
    assert depth.max_replicas > SCENARIO.min_replicas
    assert depth.final_replicas == SCENARIO.min_replicas  # it does scale down after the ramp
    # ...but also while the load is still high: empty queues say "fewer pods" whatever the
    # load, so it removes pods the load needs and puts them back once their queues overflow.
    assert depth.reversals() >= 1
    assert depth.latency_quantile(0.99) > 3 * both.latency_quantile(0.99)
    assert depth.refused_share() > 0.01
    assert depth.refused_share() < none.refused_share() / 4  # still far better than nothing


def test_the_cumulative_counter_rule_never_scales_down(runs: dict[str, Outcome]) -> None:
    counter = runs["ts-counter"]
    assert not counter.scaled_down()
    assert counter.final_replicas == counter.max_replicas == SCENARIO.max_replicas
    # Its p99 is good only because it holds every replica, long after the load has gone.
    assert counter.pod_seconds > 2 * runs["queue-depth+rps"].pod_seconds


def test_a_run_is_the_same_for_the_same_seed() -> None:
    short = replace(SCENARIO, rise_s=60.0, hold_s=30.0, fall_s=60.0, duration_s=240.0)
    first, second = (simulate(short, "queue-depth+rps", seed=7) for _ in range(2))
    assert first.answered == second.answered
    assert first.samples == second.samples
    assert simulate(short, "queue-depth+rps", seed=8).answered != first.answered


@pytest.mark.parametrize("policy", ["adaptive", "fixed"])
def test_a_concurrency_cap_below_batch_size_keeps_batches_from_filling(policy: str) -> None:
    """Knative's containerConcurrency 4 with batch_size 8: a pod never holds a full batch."""
    capped = capped_pod(SCENARIO, 4, policy, seed=1, duration_s=60.0)
    full = capped_pod(SCENARIO, SCENARIO.batch_size, policy, seed=1, duration_s=60.0)
    assert capped.mean_batch_size <= 4 < full.mean_batch_size
    assert capped.throughput_per_s < 0.7 * full.throughput_per_s
    assert full.throughput_per_s > 0.95 * SCENARIO.replica_capacity_rps
