"""Core speed and memory benchmarks of prefixcache: what the peer harness does not cover.

Sections (pick any; none picked runs all but ``--profile``):

- ``--eviction``: cost of evicting ONE block with 10^3 .. 10^6 cached blocks,
  through ``evict_cached_blocks(1)`` and through ``allocate_memory_blocks(1)``
  on a pool whose free stack is empty; Megatron-core's ``evict_lru_blocks(1)``
  beside it when the peers' venv is there.
- ``--counters``: the partition and stats counters at 10^6 blocks vs 10^3.
- ``--memory``: host bytes per block at 10^6 blocks with every block
  registered and cached (RSS delta and tracemalloc, each in a fresh process),
  beside Megatron-core's ``KVBlockAllocator`` (LRU) filled the same way.
- ``--batched``: one dynamic-batching step: 256 requests allocate, then all
  256 release, per request, inside one ``free_group()``, or as one call.
- ``--request``: per-call cost of hash / match+acquire / allocate / register /
  release on a W2-like request (large pool) and a W3-like one (evicting).
- ``--profile W1,W2,W3``: cProfile of the peer adapter on the shared
  harness's workloads (needs ``run_peers.py``; not part of the default run);
  with ``--profiler none`` it only runs them, for an outside sampler (py-spy).

Every timing is printed as min / median / max after an untimed warm-up, with
the machine, Python, torch and numpy versions first. ``--quick`` shrinks sizes
and repeats for a smoke run (about 20 s). Run from the repo root::

    PYTHONPATH=. python benchmarks/bench_core.py            # all sections, ~2-3 min
    PYTHONPATH=. python benchmarks/bench_core.py --eviction --quick
    PYTHONPATH=. python benchmarks/bench_core.py --profile W2

The Megatron parts run this same file under ``--peers-python`` (default
``$PEERS_VENV/bin/python``, ``PEERS_VENV`` defaulting to ``~/.venv-peers``, see
``../shared/bench/README.md``) in child processes; they are skipped with a
note when it is missing. ``PREFIXCACHE_ENGINE=native`` (or ``python``) picks
the engine the sections run on.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import os
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from typing import Any

import numpy as np
from corebench.common import (
    DEFAULT_HARNESS,
    DEFAULT_PEERS_PYTHON,
    FRESH_HASH_BASE,
    build_cached,
    fill_registered,
    fmt3,
    import_prefixcache,
    print_environment,
    run_peer_child,
    table,
    time_each,
)
from corebench.memory import (
    bench_memory,
    child_megatron_evict,
    child_megatron_memory,
    child_prefixcache_memory,
)
from corebench.profile import bench_profile
from corebench.request import bench_request

# --------------------------------------------------------------------------
# (a) eviction scaling
# --------------------------------------------------------------------------


class ConstantCache:
    """Evicts one block per timed call and refills one untimed, so the cache size holds."""

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator
        self._fresh_hashes = itertools.count(FRESH_HASH_BASE)
        self._held: list[Any] = []

    def evict_one(self) -> None:
        self.allocator.evict_cached_blocks(1)

    def allocate_one(self) -> None:
        self._held.append(self.allocator.allocate_memory_blocks(1))

    def refill_after_evict(self) -> None:
        self._cache(self.allocator.allocate_memory_blocks(1))

    def refill_after_allocate(self) -> None:
        self._cache(self._held.pop())

    def _cache(self, block_ids: Any) -> None:
        """Register a held block as a new one-block chain and release it: cached again."""
        self.allocator.register_kv_block_hashes(block_ids, [next(self._fresh_hashes)])
        self.allocator.release_memory_blocks(block_ids)


def bench_eviction(args: argparse.Namespace) -> None:
    """Cost of evicting one block as the number of cached blocks grows."""
    sizes = [10**3, 10**4, 10**5] if args.quick else [10**3, 10**4, 10**5, 10**6]
    warmup, repeats = (20, 200) if args.quick else (100, 2000)
    print(f"## (a) Evicting one block (chains of {args.chain_blocks} blocks, all cached)\n")
    print(
        f"Per-call µs, min / median / max over {repeats} calls after {warmup} warm-up calls. "
        "`evict_cached_blocks(1)`: the LRU leaf is freed (its parent becomes a leaf). "
        "`allocate_memory_blocks(1)`: the free stack is empty, so each call evicts one "
        "block and hands it out. After each call (untimed) one block is registered and "
        "released again, so the number of cached blocks stays constant.\n"
    )
    rows, medians = [], []
    for size in sizes:
        start = time.perf_counter()
        allocator = build_cached(size, args.chain_blocks)
        build_s = time.perf_counter() - start
        cache = ConstantCache(allocator)
        evict = time_each(cache.evict_one, warmup, repeats, cache.refill_after_evict)
        assert allocator.stats().num_free == 0 and allocator.stats().num_cached == size
        alloc = time_each(cache.allocate_one, warmup, repeats, cache.refill_after_allocate)
        assert allocator.stats().num_cached == size
        allocator.check_invariants()
        medians.append(statistics.median(evict))
        rows.append(
            [
                f"{size:,}",
                fmt3(evict, 1e6),
                fmt3(alloc, 1e6),
                f"{build_s:.2f} s ({build_s / size * 1e9:,.0f} ns/block)",
            ]
        )
        del allocator, cache
        gc.collect()
    table(
        ["cached blocks", "evict_cached_blocks(1) µs", "allocate(1) with eviction µs", "fill"],
        rows,
    )
    print(
        f"Median evict cost at {sizes[-1]:,} / at {sizes[0]:,} cached blocks: "
        f"{medians[-1] / medians[0]:.2f}x (target: within 2x).\n"
    )
    megatron_sizes = [s for s in sizes if s <= 10**5] if args.quick else sizes
    result = run_peer_child(args, ["megatron-evict", *map(str, megatron_sizes)])
    if result is None:
        return
    print(
        "Megatron-core "
        f"{result['version']} `KVBlockAllocator` (LRU) `evict_lru_blocks(1)`, same fill "
        "(chains registered with parent hashes, released), ms per call min / median / max:\n"
    )
    table(
        ["cached blocks", "evict_lru_blocks(1) ms", "calls"],
        [
            [f"{r['size']:,}", fmt3(r["samples"], 1e3), str(len(r["samples"]))]
            for r in result["rows"]
        ],
    )


# --------------------------------------------------------------------------
# (b) partition and stats counters
# --------------------------------------------------------------------------


def build_mixed(num_blocks: int, chain_blocks: int) -> Any:
    """An allocator with every block used: 1/2 cached, 1/4 paused, 1/4 active."""
    prefixcache = import_prefixcache()
    allocator = prefixcache.KVBlockAllocator(
        total_count=num_blocks + 1, paused_count=num_blocks // 4, device="cpu"
    )
    block_ids = fill_registered(allocator, num_blocks, chain_blocks)
    half, three_quarters = num_blocks // 2, 3 * num_blocks // 4
    allocator.release_memory_blocks(block_ids[half:])
    allocator.acquire_blocks(block_ids[half:])  # the second half is active again, not cached
    allocator.release_memory_blocks(block_ids[:half])
    allocator.pause(block_ids[half:three_quarters])
    return allocator


def bench_counters(args: argparse.Namespace) -> None:
    """The partition and stats counters must not depend on the pool size."""
    small, large = 10**3, (10**5 if args.quick else 10**6)
    number, repeats = (2_000, 5) if args.quick else (20_000, 15)
    print(f"## (b) Partition and stats counters at {large:,} blocks vs {small:,}\n")
    print(
        "Every block used: 1/2 cached, 1/4 paused, 1/4 active. ns per call (timeit, "
        f"{number:,} calls a sample, {repeats} samples after one warm-up sample), "
        "min / median / max.\n"
    )
    allocators = {size: build_mixed(size, args.chain_blocks) for size in (small, large)}
    calls: list[tuple[str, str]] = [
        ("get_active_used()", "get_active_used"),
        ("get_paused_used()", "get_paused_used"),
        ("get_active_avail()", "get_active_avail"),
        ("get_evictable_block_count()", "get_evictable_block_count"),
        ("get_total_used()", "get_total_used"),
        ("stats()", "stats"),
        ("is_memory_available(64)", "is_memory_available"),
    ]
    rows = []
    for label, method in calls:
        medians = []
        cells = [label]
        for size in (small, large):
            bound = getattr(allocators[size], method)
            call = (lambda f=bound: f(64)) if method == "is_memory_available" else bound
            timer = timeit.Timer(call)
            timer.timeit(number)
            samples = [t / number for t in timer.repeat(repeats, number)]
            medians.append(statistics.median(samples))
            cells.append(fmt3(samples, 1e9, 0))
        cells.append(f"{medians[1] / medians[0]:.2f}")
        rows.append(cells)
    table(["call", f"{small:,} blocks ns", f"{large:,} blocks ns", "ratio"], rows)
    print(f"State check at {large:,}: {allocators[large]}\n")


# --------------------------------------------------------------------------
# (d) batched step
# --------------------------------------------------------------------------


def step_per_request(allocator: Any, sizes: list[int]) -> None:
    held = [allocator.allocate_memory_blocks(k) for k in sizes]
    for block_ids in held:
        allocator.release_memory_blocks(block_ids)


def step_free_group(allocator: Any, sizes: list[int]) -> None:
    held = [allocator.allocate_memory_blocks(k) for k in sizes]
    with allocator.free_group():
        for block_ids in held:
            allocator.release_memory_blocks(block_ids)


def step_one_release(allocator: Any, sizes: list[int]) -> None:
    held = [allocator.allocate_memory_blocks(k) for k in sizes]
    allocator.release_memory_blocks(np.concatenate([block_ids.numpy() for block_ids in held]))


_STEPS: list[tuple[str, Callable[[Any, list[int]], None], bool]] = [
    ("per-request release", step_per_request, False),
    ("free_group() release", step_free_group, False),
    ("one release call (cat)", step_one_release, True),
]
"""(label, step, whether the step releases in a single call)."""


def bench_batched(args: argparse.Namespace) -> None:
    """One engine step: 256 requests allocate, then all 256 release."""
    prefixcache = import_prefixcache()
    num_requests = 256
    warmup, repeats = (5, 30) if args.quick else (20, 200)
    sizes = (np.random.default_rng(0).integers(1, 17, size=num_requests)).tolist()
    total_blocks = sum(sizes)
    print(f"## (d) Batched step: {num_requests} requests allocate, then release\n")
    print(
        f"Pool of 65,536 blocks; request i asks for 1-16 blocks ({total_blocks:,} blocks a "
        f"step). Allocation is one call per request, as a dynamic-batching context adds "
        "requests. Release: one call per request; the same calls inside one `free_group()` "
        "(SGLang's `free_group_begin/end`); or one call on the concatenated IDs (Megatron's "
        f"context). µs per step and calls/s ({2 * num_requests} calls a step; one call for the "
        f"single release), min / median / max over {repeats} steps after {warmup}.\n"
    )
    rows = []
    for caching in (False, True):
        allocator = prefixcache.KVBlockAllocator(
            total_count=65_536, enable_prefix_caching=caching, device="cpu"
        )
        for label, step, single_release in _STEPS:
            samples = time_each(functools.partial(step, allocator, sizes), warmup, repeats)
            num_calls = num_requests + (1 if single_release else num_requests)
            rates = [num_calls / s for s in samples]
            rows.append(
                [
                    f"{'on' if caching else 'off'}: {label}",
                    fmt3(samples, 1e6, 0),
                    fmt3(rates, 1e-3, 0),
                    f"{total_blocks * 2 / statistics.median(samples) / 1e6:,.1f}",
                ]
            )
        allocator.check_invariants()
    table(["prefix caching: release style", "µs / step", "k calls/s", "M blocks/s"], rows)


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------


def set_threads(threads: int) -> None:
    """Pin torch (and OpenMP in children) to ``threads`` intra-op threads, as the harness does."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


def child(argv: list[str], chain_blocks: int, quick: bool) -> None:
    kind, rest = argv[0], argv[1:]
    if kind == "memory":
        result = child_prefixcache_memory(int(rest[1]), chain_blocks, rest[0])
    elif kind == "megatron-memory":
        result = child_megatron_memory(int(rest[1]), chain_blocks, rest[0])
    elif kind == "megatron-evict":
        result = child_megatron_evict([int(x) for x in rest], chain_blocks, quick)
    else:
        raise SystemExit(f"unknown child {kind}")
    print(json.dumps(result))


SECTIONS = {
    "eviction": bench_eviction,
    "counters": bench_counters,
    "memory": bench_memory,
    "batched": bench_batched,
    "request": bench_request,
}


def main() -> None:
    """Parse the flags and run the chosen sections."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for name, function in SECTIONS.items():
        parser.add_argument(f"--{name}", action="store_true", help=function.__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    parser.add_argument(
        "--chain-blocks", type=int, default=16, help="blocks per registered chain (default 16)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1, as the harness)"
    )
    parser.add_argument("--peers-python", default=DEFAULT_PEERS_PYTHON)
    parser.add_argument("--profile", metavar="W1,W2,W3", help="cProfile these harness workloads")
    parser.add_argument("--harness", default=DEFAULT_HARNESS, help="path of run_peers.py")
    parser.add_argument("--profile-top", type=int, default=25, help="rows of the profile")
    parser.add_argument(
        "--profiler",
        choices=("cprofile", "none"),
        default="cprofile",
        help="'none': only run the workloads (to sample them with py-spy)",
    )
    parser.add_argument(
        "--profile-runs", type=int, default=5, help="runs per workload with --profiler none"
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    set_threads(args.threads)
    if args.child:
        child(args.child, args.chain_blocks, args.quick)
        return
    print_environment()
    if args.profile:
        bench_profile(args)
        return
    chosen = [name for name in SECTIONS if getattr(args, name)] or list(SECTIONS)
    print(f"Command: `{' '.join(['python', *sys.argv])}`\n")
    for name in chosen:
        start = time.perf_counter()
        SECTIONS[name](args)
        print(f"({name}: {time.perf_counter() - start:.1f} s)\n")


if __name__ == "__main__":
    main()
