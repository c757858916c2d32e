"""Goodput under overload: open-loop Poisson arrivals above capacity, echo model, batch 8.

    .venv/bin/python -m benchmarks.overload --rate 22000 --duration 4 --rounds 2

One batchserve serves the echo handler twice (``adaptive`` and ``fixed``, batch_size 8,
max_batch_delay 5 ms, one worker each); the load generator offers ``--rate`` requests per
second to each in turn, and reports the successful answers per second, the 503s and the batch
sizes the server dispatched. The load generator shares the machine's cores with the server.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks import loadgen
from benchmarks.echo import BODY, build_echo
from benchmarks.servers import Batchserve

POLICIES = ("adaptive", "fixed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=22000.0, help="offered requests/s")
    parser.add_argument("--duration", type=float, default=4.0, help="measured seconds per run")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    store = Path(tempfile.mkdtemp(prefix="bench-overload-"))
    build_echo(store)
    print("| round | policy | offered req/s | ok req/s | 503/s | p50 ms | batch sizes |\n"
          "|---|---|---|---|---|---|---|")
    with Batchserve(store, "enable_access_log=true\n") as server:
        for policy in POLICIES:
            server.register("echo.mar", model_name=f"echo_{policy}", batch_size=8,
                            max_batch_delay=5, initial_workers=1, batch_policy=policy)
        for round_number in range(1, args.rounds + 1):
            for policy in POLICIES:
                model = f"echo_{policy}"
                target = loadgen.HttpTarget(f"{server.inference}/predictions/{model}", [BODY])
                result = loadgen.run(target, rate=args.rate, duration_s=args.duration,
                                     warmup_s=1.0, progress=False,
                                     metrics_url=f"{server.metrics}/metrics", model=model)
                sizes = result.best_batch_sizes()
                print(f"| {round_number} | {policy} | {args.rate:,.0f} | "
                      f"{result.throughput:,.0f} | "
                      f"{result.errors.get('503', 0) / args.duration:,.0f} | "
                      f"{result.percentile_ms(50):.1f} | "
                      f"{sizes.describe() if sizes else '-'} |", flush=True)


if __name__ == "__main__":
    main()
