"""How far signals of *whether* a block comes back can take a policy: an oracle bound.

Issue 26 asks for >= 0.60 of the offline optimum at mid capacity on the chat families and
names the signals that should get there (a conversation's end, one-hit admission, a
next-use estimate). This script bounds the first two from above: ``liveness`` is told by
the replay's future which cached blocks will never be used again, evicts those first and
runs LRU over the rest. No online policy that learns *whether* a block is reused (ends,
admission, ghosts) can beat it; what it still misses against the optimum is the order of
the blocks that do come back (*when*), which only the future or the scheduler's queue
(``--queue-hints``) shows.

Usage, from the repository root::

    python benchmarks/bench_oracle_bounds.py                    # the chat families, test side
    python benchmarks/bench_oracle_bounds.py --traces multi_turn_chats:0 --capacity large

The replay hands the future only to the policy registered as ``belady``
(``prefixcache.tools.replay``); for the oracle's runs this script registers
:class:`LivenessOracle` under that name and puts Belady back afterwards.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from prefixcache.policies.belady import BeladyPolicy

from prefixcache import policies
from prefixcache.tools.replay import OPTIMUM_POLICY, replay
from prefixcache.tools.workloads import split

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_policy_split import capacities

DEFAULT_TRACES = "multi_turn_chats:2,heavy_tailed_chats:2"


class LivenessOracle(BeladyPolicy):
    """Blocks never used again go first (LRU among them), then LRU over the rest.

    Keys are ``(never used again, -last access, block ID)``: the largest is the victim, so
    a dead block beats every live one and, among equals, the least recent goes first.
    ``never`` is any next use at or past ``horizon`` (the replay's "never" is the number of
    requests).
    """

    def __init__(self, next_use: Callable[[int], int], horizon: int) -> None:
        super().__init__(next_use)
        self._horizon = horizon

    def _key(self, block_id: int, stamp: int) -> tuple[int, int, int]:
        return (int(self._next_use(block_id) >= self._horizon), -stamp, block_id)

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        """Track ``block_id`` by whether it comes back, then by its last access. O(log n)."""
        self._put(self._key(block_id, last_access))
        self.record_undo(self._remove, block_id)

    def touch(self, block_id: int, now: int) -> None:
        """A use: re-rank by the new stamp (and ask the future again). O(log n)."""
        old = self._key_of[block_id]
        key = self._key(block_id, now)
        self._remove(block_id)
        self._put(key)
        self.record_undo(self._retouch, key, old)


@contextmanager
def oracle_as_optimum(horizon: int) -> Iterator[None]:
    """Register :class:`LivenessOracle` (for ``horizon`` requests) as ``belady`` meanwhile."""
    registry = policies._registry  # the replay builds the optimum by this name

    class Bound(LivenessOracle):
        def __init__(self, next_use: Callable[[int], int]) -> None:
            super().__init__(next_use, horizon)

    saved = registry[OPTIMUM_POLICY]
    registry[OPTIMUM_POLICY] = Bound
    try:
        yield
    finally:
        registry[OPTIMUM_POLICY] = saved


def main(argv: list[str] | None = None) -> None:
    """Replay each trace with lru, the liveness oracle and the optimum; print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default=DEFAULT_TRACES, help="family:seed,...")
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--capacity", choices=("small", "mid", "large"), default="mid")
    args = parser.parse_args(argv)
    print(f"| trace | {args.capacity} (blocks) | lru | liveness oracle | optimum |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for item in args.traces.split(","):
        family, _, seed = item.partition(":")
        requests = split.load_trace(family, int(seed) if seed else None, args.requests)
        size = capacities(requests)[args.capacity]
        optimum = replay(requests, size, OPTIMUM_POLICY, progress=False).hit_rate
        lru = replay(requests, size, "lru", progress=False).hit_rate
        with oracle_as_optimum(len(requests)):
            bound = replay(requests, size, OPTIMUM_POLICY, progress=False).hit_rate
        cells = [f"{rate:.3f} ({rate / optimum:.2f})" for rate in (lru, bound)]
        print(f"| `{item}` | {size:,} | " + " | ".join(cells) + f" | {optimum:.3f} |")


if __name__ == "__main__":
    main()
