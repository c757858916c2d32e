"""The batcher that knows the batch buckets (issue 33, item 2), simulated: padding waste and
latency across offered loads, the adaptive policy told the workers' buckets ("after") against
the same policy not told them ("before": what the server did before issue 33, the workers
padding all the same). In-process and in simulated time (``frontend.serving.simulation``:
the real Batcher and Dispatcher, a worker that answers a batch of n items after
``a + b * rows``, rows its items padded to the buckets); a run takes seconds:

    .venv/bin/python -m benchmarks.bucket_policy [--duration 10] [--workers 1]

Four handlers, buckets the powers of two up to batch_size (CUDA graphs' default): B = 8 with
a fixed cost a of 20 ms a batch and b = 1 ms a row (the docs' accelerator), B = 8 at 2 + 1 ms
(cost mostly per row), B = 64 at 4 ms + 0.5 ms a row (a GPU CNN at large batches), B = 16 at
1 + 1 ms. Loads: Poisson arrivals at 30, 50, 70 and 90 % of the batched capacity
B / (a + b * B), and closed loops of clients (0.5-1.5 ms think time) around a bucket's size.
Seed 7, one worker, ``batches_in_flight`` 2 unless told otherwise.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from frontend.serving.buckets import padded_rows
from frontend.serving.policies import AdaptivePolicy
from frontend.serving.simulation import SimulationResult, simulate

#: (batch_size, max_batch_delay_s, a_s, b_s)
HANDLERS = ((8, 0.050, 0.020, 0.001), (8, 0.010, 0.002, 0.001),
            (64, 0.020, 0.004, 0.0005), (16, 0.005, 0.001, 0.001))
FRACTIONS = (0.3, 0.5, 0.7, 0.9)


def _buckets(batch_size: int) -> tuple[int, ...]:
    return tuple(2 ** i for i in range(batch_size.bit_length()) if 2 ** i <= batch_size)


def _service(a_s: float, b_s: float, buckets: tuple[int, ...]) -> Callable[[int], float]:
    return lambda items: a_s + b_s * padded_rows(items, buckets)


def _cell(result: SimulationResult) -> str:
    return (f"{result.mean_latency_s * 1e3:.1f} / {result.p99_latency_s * 1e3:.1f} ms, "
            f"{result.throughput_per_s:,.0f}/s, pad {result.padding_share:.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="simulated seconds")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    ratios: list[tuple[float, float]] = []
    print("| handler | load | before: mean / p99, throughput, padding | after | "
          "after / before mean, p99 |")
    print("|---|---|---|---|---|")
    for batch_size, delay_s, a_s, b_s in HANDLERS:
        buckets = _buckets(batch_size)
        capacity = batch_size / (a_s + b_s * batch_size)
        clients = sorted({max(2, batch_size // 2 - 1), batch_size // 2 + 1, batch_size - 1,
                          batch_size + batch_size // 2})
        loads: list[tuple[str, dict[str, float]]] = [
            (f"Poisson {fraction:.0%} ({capacity * fraction:,.0f}/s)",
             {"rate_per_s": capacity * fraction}) for fraction in FRACTIONS]
        loads += [(f"{count} clients", {"clients": count}) for count in clients]
        for name, load in loads:
            before, after = (
                simulate(AdaptivePolicy(batch_size, delay_s), max_batch_size=batch_size,
                         service_s=_service(a_s, b_s, buckets), duration_s=args.duration,
                         seed=7, workers=args.workers, batches_in_flight=2, buckets=buckets,
                         policy_knows_buckets=knows, **load)  # type: ignore[arg-type]
                for knows in (False, True))
            mean = after.mean_latency_s / before.mean_latency_s
            p99 = after.p99_latency_s / before.p99_latency_s
            ratios.append((mean, p99))
            print(f"| B={batch_size}, {a_s * 1e3:g} + {b_s * 1e3:g} ms/row | {name} | "
                  f"{_cell(before)} | {_cell(after)} | {mean:.2f}, {p99:.2f} |")

    def geomean(values: list[float]) -> float:
        return math.exp(sum(map(math.log, values)) / len(values))

    print(f"\ngeometric mean after / before over {len(ratios)} runs: mean latency "
          f"{geomean([m for m, _ in ratios]):.3f}, p99 {geomean([p for _, p in ratios]):.3f}")


if __name__ == "__main__":
    main()
