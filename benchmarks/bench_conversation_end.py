"""A conversation's end (``end_conversation``): each policy's share of the optimum, off and on.

Replays the chat families of the train/test split
(:mod:`prefixcache.tools.workloads.split`) one request at a time, as
:func:`prefixcache.tools.replay.replay` does (look up, insert, release, trim
to capacity), at mid capacity (10% of the trace's distinct blocks, as
``bench_policy_split.py``). With ends on, after a request that is its
conversation's last turn the replay calls ``end_conversation`` on its chain.
The traces do not mark last turns, so this script infers them: a request is
its conversation's last turn when no later request's chain holds its last
block's hash (chained hashes: a later turn of the same conversation extends
the whole prompt). That is what a client that closes its chat would say; an
abandoned chat would not say it, so these are upper bounds for that part.
The optimum (``belady``, no ends: it knows the future already) is the replay's.

Usage, from the repository root::

    python benchmarks/bench_conversation_end.py  # test side (seed 2), lru and auto
    python benchmarks/bench_conversation_end.py --side train --requests 800
    python benchmarks/bench_conversation_end.py --in-flight 16

``--in-flight N`` runs the concurrent loop (``replay_concurrent``, as ``prefixcache compare
--concurrency N``), ends off and on, queue hints off and on (the loop's ``belady`` runs on
the Python engine: its oracle reads block hashes from inside the policy's calls). The
results file was taken with ``PREFIXCACHE_ENGINE=python``, which was needed before that.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from bench_policy_split import capacities

from prefixcache import KVBlockAllocator
from prefixcache.reference.trace import TraceRequest, trace_block_hashes
from prefixcache.tools.replay import OPTIMUM_POLICY, replay, replay_concurrent
from prefixcache.tools.workloads import split


def last_turns(chains: Sequence[np.ndarray]) -> list[bool]:
    """Per request: whether no later request's chain holds its last block's hash."""
    last_use: dict[int, int] = {}
    for index, chain in enumerate(chains):
        for block_hash in chain.tolist():
            last_use[block_hash] = index
    return [bool(len(chain)) and last_use[int(chain[-1])] == i for i, chain in enumerate(chains)]


def hit_rate(requests: Sequence[TraceRequest], capacity: int, policy: str, ends: bool) -> float:
    """The sequential replay's hit rate, with ``end_conversation`` after last turns or not."""
    chains = [np.array(trace_block_hashes(r.hash_ids), dtype=np.int64) for r in requests]
    ending = last_turns(chains)
    longest = max(len(chain) for chain in chains)
    allocator = KVBlockAllocator(
        total_count=capacity + longest + 1,
        block_size_tokens=16,
        eviction_policy=policy,
        device="cpu",
    )
    hits = total = 0
    for hashes, last in zip(chains, ending, strict=True):
        hit_ids = allocator.match_prefix(hashes, acquire=True)
        num_hit = len(hit_ids)
        fresh = allocator.allocate_memory_blocks(len(hashes) - num_hit)
        assert fresh is not None
        if len(fresh):
            parent = int(hashes[num_hit - 1]) if num_hit else None
            allocator.register_kv_block_hashes(fresh, hashes[num_hit:], parent_hash=parent)
            allocator.release_memory_blocks(fresh)
        allocator.release_memory_blocks(hit_ids)
        if ends and last:
            allocator.end_conversation(hashes)
        excess = allocator.get_evictable_block_count() - capacity
        if excess > 0:
            allocator.evict_cached_blocks(excess)
        hits += num_hit
        total += len(hashes)
    return hits / total if total else 0.0


def concurrent_hit_rate(
    requests: Sequence[TraceRequest],
    capacity: int,
    policy: str,
    ends: bool,
    in_flight: int,
    hints: bool,
) -> float:
    """``replay_concurrent``'s hit rate, with ``end_conversation`` after a last turn finishes
    (the loop's ``_finish`` wrapped for the call: the same loop and settings otherwise)."""
    from prefixcache.reference import sim as loop

    chains = [np.array(trace_block_hashes(r.hash_ids), dtype=np.int64) for r in requests]
    last = {index for index, flag in enumerate(last_turns(chains)) if flag} if ends else set()
    original = loop.DynamicBatchingSim._finish

    def finish(self: Any) -> int:
        ending = [
            list(s.block_hashes)
            for s in self._running
            if s.is_finished and s.request.request_id in last
        ]
        num_finished = original(self)
        for hashes in ending:  # its prompt and the decode blocks it registered
            self.allocator.end_conversation(hashes)
        return num_finished

    loop.DynamicBatchingSim._finish = finish  # type: ignore[method-assign]
    try:
        return replay_concurrent(
            requests, capacity, policy, max_requests=in_flight, queue_hints=hints
        ).hit_rate
    finally:
        loop.DynamicBatchingSim._finish = original  # type: ignore[method-assign]


def main_concurrent(args: argparse.Namespace, seed: int, names: Sequence[str]) -> int:
    """The concurrent loop's table: ends off/on, queue hints off and on."""
    print(
        f"{args.side} side (seed {seed}), {args.requests} requests, mid capacity, "
        f"at most {args.in_flight} in flight, 50 ms a step"
    )
    print("\n| trace | policy | ends off | ends on | hints, ends off | hints, ends on |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for family in split.CHAT_FAMILIES:
        requests = split.load_trace(family, seed, args.requests)
        capacity = capacities(requests)["mid"]
        best = replay_concurrent(requests, capacity, OPTIMUM_POLICY, max_requests=args.in_flight)
        for name in names:
            cells = []
            for hints in (False, True):
                for ends in (False, True):
                    rate = concurrent_hit_rate(
                        requests, capacity, name, ends, args.in_flight, hints
                    )
                    cells.append(f"{rate:.3f} ({rate / best.hit_rate:.2f})")
            print(
                f"| `{family}` {capacity:,} blocks, optimum {best.hit_rate:.3f} | {name} | "
                + " | ".join(cells)
                + " |",
                flush=True,
            )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=("test", "train"), default="test")
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--policies", default="lru,auto")
    parser.add_argument("--in-flight", type=int, default=0, help="N > 0: the concurrent loop")
    args = parser.parse_args(argv)
    seed = split.TEST_SEED if args.side == "test" else split.TRAIN_SEEDS[0]
    names = args.policies.split(",")
    if args.in_flight:
        return main_concurrent(args, seed, names)
    print(f"{args.side} side (seed {seed}), {args.requests} requests, mid capacity, sequential")
    print(
        "\n| trace | optimum | last turns | "
        + " | ".join(f"{n} off | {n} on" for n in names)
        + " |"
    )
    print("| --- | ---: | ---: | " + " | ".join("---: | ---:" for _ in names) + " |")
    for family in split.CHAT_FAMILIES:
        start = time.perf_counter()
        requests = split.load_trace(family, seed, args.requests)
        capacity = capacities(requests)["mid"]
        best = replay(requests, capacity, OPTIMUM_POLICY).hit_rate
        chains = [np.array(trace_block_hashes(r.hash_ids), dtype=np.int64) for r in requests]
        cells = []
        for name in names:
            for ends in (False, True):
                rate = hit_rate(requests, capacity, name, ends)
                cells.append(f"{rate:.3f} ({rate / best:.2f})" if best else f"{rate:.3f}")
        print(
            f"| `{family}` {capacity:,} blocks | {best:.3f} | {sum(last_turns(chains))} | "
            + " | ".join(cells)
            + f" |  <!-- {time.perf_counter() - start:.0f} s -->"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
