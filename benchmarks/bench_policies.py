"""Per-event cost of every eviction policy at 10^3 .. 10^6 tracked leaves.

For each policy and size the policy is filled with ``size`` leaves, then each
event is timed in rounds of ``--ops`` calls at steady size: ``insert`` (of a
new block, paired with an untimed ``evict(1)`` to keep the size), ``discard``
(paired with an untimed re-insert), ``touch``, and ``evict(1)`` (paired with
an untimed insert). Each block gets a hash, a reuse count and a depth drawn
from a seeded generator. The first round is a warm-up; the table shows
min/median/max of the remaining rounds in nanoseconds per call.

Run: ``PYTHONPATH=. python benchmarks/bench_policies.py [--max-size 1000000]``.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

from prefixcache import policies

SIZES = (1_000, 10_000, 100_000, 1_000_000)
SKIPPED = {"belady", "ref_zero"}  # needs the future / tracks nothing


def _time_rounds(step: Callable[[], None], ops: int, rounds: int) -> list[float]:
    """ns per call of ``step`` over ``rounds`` rounds of ``ops`` calls, warm-up dropped."""
    samples = []
    for _ in range(rounds + 1):
        start = time.perf_counter_ns()
        for _ in range(ops):
            step()
        samples.append((time.perf_counter_ns() - start) / ops)
    return samples[1:]


def bench_policy(name: str, size: int, ops: int, rounds: int) -> dict[str, list[float]]:
    """Timings of each event for policy ``name`` holding ``size`` leaves."""
    rng = random.Random(size)
    policy = policies.get(name)
    clock = 0
    next_id = 0

    def insert_new() -> None:
        nonlocal clock, next_id
        clock += 1
        next_id += 1
        policy.insert(next_id, next_id * 7919, clock, rng.randint(1, 4), rng.randrange(64))

    for _ in range(size):
        insert_new()
    tracked: list[int] = []

    def refresh_tracked() -> None:
        tracked[:] = rng.sample(range(next_id - size + 1, next_id + 1), 64)
        tracked[:] = [block_id for block_id in tracked if block_id in policy]

    def insert_event() -> None:
        insert_new()
        policy.evict(1)

    def discard_event() -> None:
        nonlocal clock
        if not tracked:
            refresh_tracked()
        block_id = tracked.pop()
        if block_id in policy:
            policy.discard(block_id)
            clock += 1
            policy.insert(block_id, block_id * 7919, clock, 2, 1)

    def touch_event() -> None:
        nonlocal clock
        if not tracked:
            refresh_tracked()
        block_id = tracked.pop()
        if block_id in policy:
            clock += 1
            policy.touch(block_id, clock)

    def evict_event() -> None:
        policy.evict(1)
        insert_new()

    return {
        "insert+evict": _time_rounds(insert_event, ops, rounds),
        "discard+insert": _time_rounds(discard_event, ops, rounds),
        "touch": _time_rounds(touch_event, ops, rounds),
        "evict+insert": _time_rounds(evict_event, ops, rounds),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-size", type=int, default=SIZES[-1])
    parser.add_argument("--ops", type=int, default=2_000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after the warm-up")
    parser.add_argument("--policies", default=None, help="comma-separated names (default: all)")
    args = parser.parse_args()
    names = args.policies.split(",") if args.policies else policies.available()
    names = [name for name in names if name not in SKIPPED]
    print(f"machine: {platform.machine()} {platform.processor() or ''} {platform.system()}")
    print(f"python: {sys.version.split()[0]} ({platform.python_implementation()})")
    print(f"rounds: {args.rounds} x {args.ops} calls after one warm-up round; ns per call\n")
    print("| policy | leaves | event | min | median | max |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for name in names:
        for size in (s for s in SIZES if s <= args.max_size):
            for event, samples in bench_policy(name, size, args.ops, args.rounds).items():
                print(
                    f"| {name} | {size:,} | {event} | {min(samples):,.0f} "
                    f"| {statistics.median(samples):,.0f} | {max(samples):,.0f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
