"""Batch policies: TorchServe's fixed rule exactly, and the adaptive one driven by a fake clock;
then whole workloads replayed through the real Batcher and Dispatcher in simulated time."""

from __future__ import annotations

import math
import random

import pytest

from frontend.serving.policies import (
    STALE_GAPS,
    AdaptivePolicy,
    FixedPolicy,
    PolicyName,
    make_policy,
)
from frontend.serving.simulation import SimulatedTime, linear_service, simulate

B = 8
D = 0.050
A_S, B_S = 0.020, 0.001  # the handler: 20 ms per batch + 1 ms per item


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def _learned(clock: FakeClock) -> AdaptivePolicy:
    """A policy that has seen batches of every size cost 20 + 1*n ms, then a quiet spell."""
    policy = AdaptivePolicy(B, D)
    for size in (1, 3, 8, 2, 5, 8, 4, 7, 1, 6):
        policy.on_completed(size, A_S + B_S * size, clock.advance(0.1))
    clock.advance(10.0)  # long past any echo of those answers
    return policy


def _arrive(policy: AdaptivePolicy, clock: FakeClock, count: int, gap_s: float) -> None:
    for _ in range(count):
        policy.on_arrival(clock.advance(gap_s))


# -- fixed ------------------------------------------------------------------------------------


def test_fixed_policy_is_torchserves_rule() -> None:
    policy = FixedPolicy(max_batch_size=8, max_delay_s=0.05)
    policy.on_arrival(0.0)
    policy.on_completed(3, 0.02, 0.0)
    assert policy.wait_s(queued=8, waited_s=0.0, idle_workers=1, now=0.0) == 0.0
    assert policy.wait_s(queued=9, waited_s=0.01, idle_workers=1, now=0.0) == 0.0
    assert policy.wait_s(queued=1, waited_s=0.0, idle_workers=1, now=0.0) == pytest.approx(0.05)
    assert policy.wait_s(queued=3, waited_s=0.03, idle_workers=4, now=9.0) == pytest.approx(0.02)
    assert policy.wait_s(queued=7, waited_s=0.05, idle_workers=1, now=0.0) <= 0
    assert policy.wait_s(queued=1, waited_s=0.06, idle_workers=1, now=0.0) < 0


def test_fixed_policy_without_delay_never_waits() -> None:
    assert FixedPolicy(8, 0.0).wait_s(1, 0.0, 1, 0.0) <= 0


# -- adaptive: when it dispatches at once -------------------------------------------------------


def test_the_first_request_ever_goes_at_once() -> None:
    clock = FakeClock()
    policy = AdaptivePolicy(B, D)
    policy.on_arrival(clock.now)
    assert policy.wait_s(1, 0.0, 1, clock.now) <= 0


def test_a_dense_stream_is_waited_for_roughly_the_time_to_fill() -> None:
    clock = FakeClock()
    policy = _learned(clock)
    _arrive(policy, clock, 20, gap_s=0.001)
    assert policy.mean_gap_s() == pytest.approx(0.001)
    wait = policy.wait_s(1, 0.0, 1, clock.now)
    # 7 missing jobs, one per ms: about 7 ms, never past the budget.
    assert 0.005 <= wait <= 0.009
    waited = 0.045
    assert 0 < policy.wait_s(1, waited, 1, clock.now) <= D - waited + 1e-12


def test_a_full_queue_goes_at_once() -> None:
    clock = FakeClock()
    policy = _learned(clock)
    _arrive(policy, clock, 20, gap_s=0.001)
    assert policy.wait_s(B, 0.0, 1, clock.now) <= 0
    assert policy.wait_s(B + 5, 0.0, 1, clock.now) <= 0


def test_another_idle_worker_means_dispatch_now() -> None:
    clock = FakeClock()
    policy = _learned(clock)
    _arrive(policy, clock, 20, gap_s=0.001)
    assert policy.wait_s(1, 0.0, 1, clock.now) > 0
    assert policy.wait_s(1, 0.0, 2, clock.now) <= 0


def test_the_budget_is_never_exceeded_even_when_waiting_pays() -> None:
    clock = FakeClock()
    policy = _learned(clock)
    _arrive(policy, clock, 20, gap_s=0.001)
    assert policy.wait_s(1, D, 1, clock.now) <= 0
    assert policy.wait_s(1, D + 0.01, 1, clock.now) <= 0


def test_a_lone_request_after_a_silence_goes_at_once() -> None:
    clock = FakeClock()
    policy = _learned(clock)
    _arrive(policy, clock, 30, gap_s=0.001)  # a burst: waiting pays
    assert policy.wait_s(1, 0.0, 1, clock.now) > 0
    clock.advance(10.0)
    policy.on_arrival(clock.now)
    assert policy.wait_s(1, 0.0, 1, clock.now) <= 0


def test_it_lets_go_when_the_stream_pauses() -> None:
    clock = FakeClock()
    policy = _learned(clock)
    _arrive(policy, clock, 20, gap_s=0.001)
    assert policy.wait_s(3, 0.0, 1, clock.now) > 0
    clock.advance(STALE_GAPS * 0.001 + 1e-6)  # no job for STALE_GAPS mean gaps
    assert policy.wait_s(3, 0.0045, 1, clock.now) <= 0


def test_it_stops_waiting_when_the_rate_drops() -> None:
    clock = FakeClock()
    policy = _learned(clock)
    _arrive(policy, clock, 20, gap_s=0.001)
    assert policy.wait_s(1, 0.0, 1, clock.now) > 0
    _arrive(policy, clock, 4, gap_s=0.030)  # a batch of 8 now takes 240 ms to gather
    assert policy.wait_s(1, 0.0, 1, clock.now) <= 0


def test_waiting_must_pay_for_itself() -> None:
    clock = FakeClock()
    policy = AdaptivePolicy(B, D)
    # Cost proportional to size (no fixed cost per batch): batching saves nothing.
    for size in (1, 4, 8, 2, 6):
        policy.on_completed(size, 0.003 * size, clock.advance(0.1))
    clock.advance(10.0)
    _arrive(policy, clock, 20, gap_s=0.001)
    assert policy.wait_s(1, 0.0, 1, clock.now) <= 0


def test_asking_changes_nothing() -> None:
    clock = FakeClock()
    policy = _learned(clock)
    _arrive(policy, clock, 20, gap_s=0.001)
    first = policy.wait_s(2, 0.001, 1, clock.now)
    assert [policy.wait_s(2, 0.001, 1, clock.now) for _ in range(3)] == [first] * 3


def test_the_wait_never_passes_the_budget_in_any_state() -> None:
    rng = random.Random(20240611)
    for trial in range(200):
        size = rng.choice((1, 2, 4, 8, 32))
        delay = rng.choice((0.0, 0.001, 0.01, 0.05, 0.5))
        policy = AdaptivePolicy(size, delay)
        clock = FakeClock(rng.uniform(0, 1e6))
        for _ in range(rng.randrange(1, 120)):
            event = rng.random()
            if event < 0.6:
                # bursts, dense streams and long silences alike
                clock.advance(rng.choice((0.0, 1e-5, 1e-3, 0.02, 3.0)) * rng.random())
                policy.on_arrival(clock.now)
            elif event < 0.8:
                n = rng.randrange(1, size + 1)
                policy.on_completed(n, rng.uniform(0, 0.2), clock.advance(rng.random() * 0.05))
            else:
                queued = rng.randrange(1, 2 * size + 2)
                waited = rng.uniform(0, 2 * delay + 0.01)
                idle = rng.randrange(1, 4)
                wait = policy.wait_s(queued, waited, idle, clock.now)
                assert math.isfinite(wait), trial
                assert wait <= max(0.0, delay - waited) + 1e-12, trial
                if queued >= size or waited >= delay or idle > 1:
                    assert wait <= 0, trial


# -- adaptive: what it learns -----------------------------------------------------------------


def test_the_service_time_is_fitted_as_a_line() -> None:
    clock = FakeClock()
    policy = _learned(clock)
    assert policy.service_model == pytest.approx((A_S, B_S))


def test_one_batch_size_alone_assumes_no_fixed_cost() -> None:
    policy = AdaptivePolicy(B, D)
    assert policy.service_model is None
    for _ in range(5):
        policy.on_completed(8, 0.028, 0.0)
    overhead, per_item = policy.service_model or (None, None)
    assert overhead == pytest.approx(0.0, abs=1e-12)
    assert per_item == pytest.approx(0.028 / 8)


def test_closed_loop_clients_are_waited_for() -> None:
    """Eight clients that resend ~1 ms after their answer: gather all eight again."""
    clock = FakeClock()
    policy = _learned(clock)
    for _ in range(30):
        policy.on_completed(B, A_S + B_S * B, clock.advance(0.028))
        _arrive(policy, clock, B, gap_s=0.000125)
    assert policy.echo_ratio > 0.9
    policy.on_completed(4, A_S + B_S * 4, clock.advance(0.028))
    _arrive(policy, clock, 1, gap_s=0.000125)
    wait = policy.wait_s(1, 0.0, 1, clock.now)
    assert 0 < wait < 0.005  # the echoes are due within a few ms
    clock.advance(0.010)  # they never came: let go
    assert policy.wait_s(1, 0.010, 1, clock.now) <= 0


# -- simulated workloads: the real Batcher and Dispatcher, simulated time --------------------

SERVICE = linear_service(A_S, B_S)


def _run(policy: FixedPolicy | AdaptivePolicy, *, size: int = B, rate_per_s: float | None = None,
         clients: int | None = None, duration_s: float) -> tuple[float, float, float]:
    result = simulate(policy, max_batch_size=size, service_s=SERVICE, rate_per_s=rate_per_s,
                      clients=clients, duration_s=duration_s, seed=7)
    return result.mean_latency_s, result.throughput_per_s, result.mean_batch_size


def test_at_low_load_adaptive_is_as_fast_as_no_batching() -> None:
    unbatched, _, _ = _run(FixedPolicy(1, 0.0), size=1, rate_per_s=2.0, duration_s=200.0)
    fixed, _, _ = _run(FixedPolicy(B, D), rate_per_s=2.0, duration_s=200.0)
    adaptive, _, _ = _run(AdaptivePolicy(B, D), rate_per_s=2.0, duration_s=200.0)
    assert adaptive <= unbatched + 0.002
    assert fixed >= unbatched + 0.040  # TorchServe waits D for company that never comes


def test_at_overload_adaptive_batches_fully() -> None:
    # 300 req/s against an unbatched capacity of ~47/s (and 286/s in batches of 8)
    _, fixed_throughput, _ = _run(FixedPolicy(B, D), rate_per_s=300.0, duration_s=10.0)
    _, throughput, batch_size = _run(AdaptivePolicy(B, D), rate_per_s=300.0, duration_s=10.0)
    assert throughput >= 0.95 * fixed_throughput
    assert batch_size >= 6


@pytest.mark.parametrize("clients", [4, 8])
def test_closed_loop_clients_get_full_batches_without_the_delay(clients: int) -> None:
    greedy, greedy_throughput, _ = _run(FixedPolicy(B, 0.0), clients=clients, duration_s=5.0)
    fixed, fixed_throughput, _ = _run(FixedPolicy(B, D), clients=clients, duration_s=5.0)
    adaptive, throughput, batch_size = _run(AdaptivePolicy(B, D), clients=clients,
                                            duration_s=5.0)
    assert batch_size >= clients - 0.1
    assert adaptive <= min(greedy, fixed) + 0.001
    assert throughput >= 0.97 * max(greedy_throughput, fixed_throughput)


def test_with_several_workers_adaptive_beats_fixed_for_closed_loop_clients() -> None:
    # 8 clients on 4 workers: fixed waits to fill one batch of 8; adaptive sends a batch to
    # each free worker at once (the idle_workers rule).
    runs = {name: simulate(policy, max_batch_size=B, service_s=SERVICE, clients=8, workers=4,
                           batches_in_flight=2, duration_s=5.0, seed=7)
            for name, policy in (("fixed", FixedPolicy(B, D)), ("adaptive", AdaptivePolicy(B, D)))}
    assert runs["adaptive"].mean_latency_s <= runs["fixed"].mean_latency_s - 0.003
    assert runs["adaptive"].throughput_per_s >= runs["fixed"].throughput_per_s


def test_simulated_time_runs_each_timer_at_its_own_time_in_order() -> None:
    time = SimulatedTime(start=1000.0)
    ran: list[tuple[str, float]] = []
    time.call_later(0.2, lambda: ran.append(("b", time())))
    time.call_later(0.1, lambda: ran.append(("a", time())))
    time.call_later(0.1, lambda: time.call_later(0.0, lambda: ran.append(("a2", time()))))
    time.call_later(0.15, lambda: ran.append(("cancelled", time()))).cancel()
    time.call_later(1e-20, lambda: ran.append(("tiny", time())))  # below the clock's resolution
    time.advance(0.15)
    assert ran[0][0] == "tiny" and ran[0][1] > 1000.0  # later than now, as on a real clock
    assert ran[1:] == [("a", 1000.1), ("a2", 1000.1)] and time() == 1000.15
    assert time.pending == 1
    time.run()
    assert ran[-1] == ("b", 1000.2) and time.pending == 0


def test_simulate_needs_exactly_one_kind_of_load() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        simulate(FixedPolicy(1, 0.0), max_batch_size=1, service_s=SERVICE)
    with pytest.raises(ValueError, match="exactly one"):
        simulate(FixedPolicy(1, 0.0), max_batch_size=1, service_s=SERVICE, rate_per_s=1.0,
                 clients=1)


# -- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "kind"), [
    ("fixed", FixedPolicy), ("adaptive", AdaptivePolicy), (" Adaptive ", AdaptivePolicy),
    (PolicyName.FIXED, FixedPolicy),
])
def test_make_policy(name: str, kind: type) -> None:
    policy = make_policy(name, 8, 0.05)
    assert isinstance(policy, kind)


def test_make_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="'fixed', 'adaptive'"):
        make_policy("greedy", 8, 0.05)


@pytest.mark.parametrize(("size", "delay"), [(0, 0.05), (True, 0.05), (8, -0.01),
                                              (8, math.inf), (8, math.nan)])
def test_policies_refuse_bad_limits(size: int, delay: float) -> None:
    with pytest.raises(ValueError):
        make_policy("adaptive", size, delay)
    with pytest.raises(ValueError):
        FixedPolicy(size, delay)


def test_closed_loop_rounds_are_not_split_when_the_cost_is_mostly_per_item() -> None:
    # ResNet-152 on a CPU: s(n) = 35 ms + 75 ms per image. For one round alone, sending a
    # straggler now beats making it wait for the others; round after round that split costs a
    # once more per round. Adaptive must gather the round, as fixed does.
    service = linear_service(0.035, 0.075)
    runs = {name: simulate(policy, max_batch_size=8, service_s=service, clients=8,
                           duration_s=60, seed=7)
            for name, policy in (("fixed", FixedPolicy(8, 0.05)),
                                 ("adaptive", AdaptivePolicy(8, 0.05)))}
    assert runs["adaptive"].mean_batch_size >= 6
    assert runs["adaptive"].throughput_per_s >= 0.97 * runs["fixed"].throughput_per_s
